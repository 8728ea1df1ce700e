"""Attention inside vLLM's CPU engine (`DeepseekV4CPUAttention.forward_mqa`, installed by
`dsv4_torch.vllm.cpu_engine`): prefill tokens through our CPU kernel (`planner/csrc`,
`dsv4_prefill_attention`, reading vLLM's fp8_ds_mla pages in place), decode tokens (and prefill
tokens with DSV4_PREFILL_VLLM_CPU_PREFILL=vllm) through vLLM's `flash_mla_with_kvcache_cpu`, fed
slot lists built once per step per kind. Also the call counters and timers (`STATS`) that the
engine's metadata builders add to.
"""

from __future__ import annotations

import ctypes
import functools
import time

from dsv4_torch.vllm.cpu_metadata import StepMetadata, local_to_global

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


def _kernel():
    from planner import ckernel

    return ckernel


def _kv_source(cache, page_size: int, block_table):
    ck = _kernel()
    if cache.dtype.itemsize != 1 or cache.dim() < 2:
        raise ValueError(f"dsv4-prefill: expected an fp8_ds_mla (uint8) cache, got {cache.dtype} {tuple(cache.shape)}")
    if block_table.dtype not in (_torch().int32, _torch().int64) or block_table.dim() != 2:
        raise ValueError(
            f"dsv4-prefill: block table: expected int32/int64 [reqs, pages], got {block_table.dtype} "
            f"{tuple(block_table.shape)}"
        )
    return ck.KVSource(
        format=1,
        dtype=ck.BF16,
        data=cache.data_ptr(),
        row_stride=0,
        num_rows=0,
        page_stride=cache.stride(0),
        num_pages=cache.shape[0],
        page_size=int(page_size),
        table=block_table.data_ptr(),
        table_int64=int(block_table.dtype == _torch().int64),
        table_stride=block_table.stride(0),
        table_width=block_table.shape[1],
        table_rows=block_table.shape[0],
    )


def _torch():
    import torch

    return torch


@timed("dsv4_prefill_seconds")
def prefill_attention(layer, q, output, step: StepMetadata, swa_md, mla_md) -> None:
    """Our CPU kernel on the step's prefill tokens of one layer, straight from vLLM's caches."""
    import torch

    ck = _kernel()
    lib = ck.library()
    kind = "SWA" if layer.compress_ratio <= 1 else ("CSA" if layer.compress_ratio == 4 else "HCA")
    if q.dtype != torch.bfloat16 or q.stride(-1) != 1 or output.dtype != torch.bfloat16 or output.stride(-1) != 1:
        raise ValueError(
            f"dsv4-prefill: q / out: expected bf16 with a contiguous last dim, got {q.dtype} {q.stride()} "
            f"/ {output.dtype} {output.stride()}"
        )
    sink = layer.attn_sink
    if sink.dtype != torch.float32 or not sink.is_contiguous():
        sink = sink.float().contiguous()
    topk, topk_stride, topk_width = None, 0, 0
    if kind == "CSA":
        buf = layer.topk_indices_buffer
        topk, topk_stride, topk_width = buf.data_ptr(), buf.stride(0), layer.indexer.topk_tokens
        if buf.dtype != torch.int32:
            raise ValueError(f"dsv4-prefill: topk_indices_buffer: expected int32, got {buf.dtype}")
    tokens = ck.PrefillTokens(
        kind=ck.KIND_CODES[kind],
        window=int(layer.window_size),
        compress_ratio=max(1, int(layer.compress_ratio)),
        num_tokens=step.num_prefill_tokens,
        token_row=step.prefill_row.ctypes.data,
        token_request=step.prefill_request.ctypes.data,
        token_position=step.prefill_position.ctypes.data,
        topk=topk,
        topk_int64=0,
        topk_stride=topk_stride,
        topk_width=topk_width,
    )
    swa_cache = layer.swa_cache_layer.kv_cache
    raw = _kv_source(swa_cache, swa_md.block_size, swa_md.block_table)
    comp = None
    if kind != "SWA":
        comp = _kv_source(layer.kv_cache, mla_md.block_size // layer.compress_ratio, mla_md.block_table)
    outs = ck.Outputs(
        out=output.data_ptr(), out_s0=output.stride(0), out_s1=output.stride(1), max_logits=None, lse=None, stat_s0=0
    )
    threads = max(1, torch.get_num_threads())  # vLLM's worker binds its OpenMP threads to its cores
    STATS["threads"] = threads
    rc = lib.dsv4_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        ck.BF16,
        layer.n_local_heads,
        q.shape[-1],
        ctypes.byref(tokens),
        ctypes.byref(raw),
        ctypes.byref(comp) if comp is not None else None,
        float(layer.scale),
        sink.data_ptr(),
        ctypes.byref(outs),
        threads,
        -1,
    )
    ck.check(rc)
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
    if layer.compress_ratio <= 1:
        comp_slots = window_slots.new_full((n, 0), -1)
        comp_2d, comp_bs = window_2d, 1
    else:
        comp_bs = mla_md.block_size // layer.compress_ratio
        if layer.compress_ratio == 4:
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
    mla_md = md.get(self.prefix) if self.compress_ratio > 1 else None
    nd, nt = step.num_decode_tokens, step.num_actual_tokens
    if nt < q.shape[0]:
        output[nt:].zero_()
    ours = step.kernel == "dsv4"
    n_vllm = nd if ours else nt
    if n_vllm > 0:
        vllm_attention(self, q, output, step, swa_md, mla_md, n_vllm)
    if ours and nt > nd:
        prefill_attention(self, q, output, step, swa_md, mla_md)
