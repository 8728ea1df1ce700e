"""Attention inside vLLM's CPU engine (`DeepseekV4CPUAttention.forward_mqa`, installed by
`dsv4_torch.vllm.cpu.engine`): prefill tokens through our CPU kernel (`dsv4_cpu`,
`dsv4_prefill_attention`, reading vLLM's fp8_ds_mla pages in place, on torch's threads), decode tokens (and prefill
tokens with DSV4_PREFILL_VLLM_CPU_PREFILL=vllm) through vLLM's `flash_mla_with_kvcache_cpu`, fed
slot lists built once per step per kind. Also the call counters and timers (`STATS`) that the
engine's metadata builders add to.
"""

from __future__ import annotations

import functools
import time

from dsv4_torch.vllm.cpu.metadata import StepMetadata, local_to_global

STEP_ATTR = "_dsv4_prefill_step"  # where the SWA builder leaves the step on vLLM's metadata object

# Calls since the process started (tests and benchmarks read them): steps built, layers whose
# prefill tokens went through our kernel, layer calls of vLLM's kernel and the tokens they carried.
# Seconds: host metadata builds, our kernel's calls, vLLM's kernel's calls (slot lists included).
STATS = {
    "steps": 0,
    "dsv4_prefill_calls": 0,
    "dsv4_prefill_tokens": 0,
    "vllm_kernel_calls": 0,
    "vllm_kernel_tokens": 0,
    "metadata_seconds": 0.0,
    "dsv4_prefill_seconds": 0.0,
    "vllm_kernel_seconds": 0.0,
    "threads": 0,
    "dsv4_indexer_calls": 0,  # SparseAttnIndexer.forward_cpu calls through our indexer (dsv4_torch.vllm.cpu.indexer)
    "dsv4_indexer_tokens": 0,
    "dsv4_indexer_seconds": 0.0,
    "vllm_indexer_seconds": 0.0,  # vLLM's own forward_cpu (prefill kernel "vllm" / "dsv4-attention")
}


def timed(stat: str):
    """Add the wrapped call's wall time to STATS[stat]."""

    def wrap(fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                STATS[stat] += time.perf_counter() - t

        return timed

    return wrap


def layer_kind(layer) -> str:
    """The layer's kind as vLLM's model built it: CSA when it has an indexer, HCA when it has a
    compressed cache without one (vLLM's `compress_ratio > 1`), else SWA."""
    if getattr(layer, "indexer", None) is not None:
        return "CSA"
    return "HCA" if layer.compress_ratio > 1 else "SWA"


def _step_tokens(step: StepMetadata):
    """(3, n) int32 host array of the step's prefill tokens (q row, request, position), made once
    per step and kept on it."""
    import numpy as np

    tok = step.__dict__.get("_dsv4_tokens")
    if tok is None:
        tok = np.stack([step.prefill_row, step.prefill_request, step.prefill_position]).astype(np.int32)
        step.__dict__["_dsv4_tokens"] = tok
    return tok


@timed("dsv4_prefill_seconds")
def prefill_attention(layer, q, output, step: StepMetadata, swa_md, mla_md) -> None:
    """Our CPU kernel on the step's prefill tokens of one layer, straight from vLLM's caches
    (fp8_ds_mla pages), on torch's threads (`dsv4_torch.kernels.cpu.attention`)."""
    import torch

    from dsv4_torch.kernels.cpu import attention as cpu

    kind = layer_kind(layer)
    if q.dtype != torch.bfloat16 or output.dtype != torch.bfloat16 or output.stride(-1) != 1:
        raise ValueError(
            f"dsv4-prefill: q / out: expected bf16 with a contiguous last dim, got {q.dtype} {q.stride()} "
            f"/ {output.dtype} {output.stride()}"
        )
    keep: list = []
    swa_cache = layer.swa_cache_layer.kv_cache
    raw = cpu.paged_source(swa_cache, swa_md.block_table, swa_md.block_size, True, q.dtype, "swa_cache", keep)
    comp = None
    if kind != "SWA":
        comp_bs = mla_md.block_size // layer.compress_ratio
        comp = cpu.paged_source(layer.kv_cache, mla_md.block_table, comp_bs, True, q.dtype, "compressed_cache", keep)
    topk = None
    if kind == "CSA":
        topk = layer.topk_indices_buffer[:, : layer.indexer.topk_tokens]
    threads = max(1, torch.get_num_threads())  # vLLM's worker binds its OpenMP threads to its cores
    STATS["threads"] = threads
    cpu.prefill_attention(
        q,
        _step_tokens(step),
        raw,
        comp,
        topk,
        layer.attn_sink,
        kind=kind,
        window=int(layer.window_size),
        compress_ratio=max(1, int(layer.compress_ratio)),
        sm_scale=float(layer.scale),
        out=output,
        threads=threads,
    )
    STATS["dsv4_prefill_calls"] += 1
    STATS["dsv4_prefill_tokens"] += step.num_prefill_tokens


@timed("vllm_kernel_seconds")
def vllm_attention(layer, q, output, step: StepMetadata, swa_md, mla_md, n: int) -> None:
    """vLLM's `flash_mla_with_kvcache_cpu` on the first n tokens (decodes first), slot lists once
    per step per kind (window, HCA) or mapped per layer (the CSA top-k)."""
    import torch

    swa_cache = layer.swa_cache_layer.kv_cache
    window_2d = swa_cache.view(swa_cache.shape[0], -1)
    window_slots = torch.from_numpy(step.window_slots(swa_md.block_table, swa_md.block_size, layer.window_size, n))
    kind = layer_kind(layer)
    if kind == "SWA":
        comp_slots = window_slots.new_full((n, 0), -1)
        comp_2d, comp_bs = window_2d, 1
    else:
        comp_bs = mla_md.block_size // layer.compress_ratio
        if kind == "CSA":
            local = layer.topk_indices_buffer[:n].numpy()
            comp_slots = torch.from_numpy(local_to_global(local, step.request[:n], mla_md.block_table, comp_bs))
        else:
            width = -(-layer.max_model_len // layer.compress_ratio)
            comp_slots = torch.from_numpy(
                step.visible_slots(mla_md.block_table, comp_bs, layer.compress_ratio, width, n)
            )
        comp_2d = layer.kv_cache.view(layer.kv_cache.shape[0], -1)
    torch.ops._C.flash_mla_with_kvcache_cpu(
        output[:n],
        q[:n],
        window_2d,
        window_slots,
        swa_md.block_size,
        comp_2d,
        comp_slots,
        comp_bs,
        layer.attn_sink,
        layer.scale,
    )
    STATS["vllm_kernel_calls"] += 1
    STATS["vllm_kernel_tokens"] += n


def forward_mqa(self, q, kv, positions, output) -> None:
    """DeepseekV4CPUAttention.forward_mqa: decode tokens through vLLM's kernel, prefill tokens
    through ours (or vLLM's: DSV4_PREFILL_VLLM_CPU_PREFILL=vllm); padding rows get zeros."""
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    if md is None:  # warmup / profile run
        output.zero_()
        return
    swa_md = md[self.swa_cache_layer.prefix]
    step = swa_md.__dict__.get(STEP_ATTR)
    if step is None:
        raise RuntimeError("dsv4-prefill: the SWA metadata has no step: its builder was not the plugin's")
    mla_md = md.get(self.prefix) if layer_kind(self) != "SWA" else None
    nd, nt = step.num_decode_tokens, step.num_actual_tokens
    if nt < q.shape[0]:
        output[nt:].zero_()
    ours = step.kernel != "vllm"  # dsv4 / dsv4-attention
    n_vllm = nd if ours else nt
    if n_vllm > 0:
        vllm_attention(self, q, output, step, swa_md, mla_md, n_vllm)
    if ours and nt > nd:
        prefill_attention(self, q, output, step, swa_md, mla_md)
