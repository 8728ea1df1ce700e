"""The backend "cpu" for JAX, its library: the C/C++ kernels of `dsv4_cpu` as XLA FFI custom calls.

The handlers (`dsv4_cpu/csrc/xla_ffi.cc`, `xla_indexer.cc`) are built against jaxlib's FFI
headers into a library linked against the kernels' library (`dsv4_cpu.build.build_xla`),
registered once per process as custom-call targets on the CPU platform (`TARGETS`), and run their
parallel work on XLA's intra-op thread pool (never threads of their own). The calls of this
folder (`attention`, `kvcache`, `indexer`, `prefill`) share `require`, `dtype_unavailable` and
`no_backward`: an FFI call has no derivative rule, so a gradient through one raises
NotImplementedError, never a wrong or zero gradient.
"""

from __future__ import annotations

import ctypes
import threading

import jax
import jax.numpy as jnp

from dsv4_cpu import binding, build
from planner.contract import backend_unavailable

# custom-call target -> handler symbol in the library
TARGETS = {
    "dsv4_gather_dequant": "Dsv4GatherDequant",
    "dsv4_gather_segments": "Dsv4GatherSegments",
    "dsv4_sparse_attention": "Dsv4SparseAttention",
    "dsv4_prefill_attention": "Dsv4PrefillAttention",
    "dsv4_prefill_attention_into": "Dsv4PrefillAttentionInto",
    "dsv4_indexer_topk": "Dsv4IndexerTopk",  # dsv4_jax.kernels.cpu.indexer
    "dsv4_indexer_topk_select": "Dsv4IndexerTopkSelect",  # (the two-level top-k's level 1)
    "dsv4_indexer_topk_restrict": "Dsv4IndexerTopkRestrict",  # (and its level 2)
    "dsv4_gather_mxfp8": "Dsv4GatherMxfp8",  # dsv4_jax.kernels.cpu.kvcache_v41 (V4.1 records)
}

_lock = threading.Lock()
_state: dict = {}


def ffi_library() -> str:
    """The path of the FFI handlers' library for this jaxlib (built on first use)."""
    import jaxlib

    return build.build_xla(jax.ffi.include_dir(), f"jaxlib {jaxlib.__version__}")


def _register() -> None:
    with _lock:
        if "ok" in _state or "error" in _state:
            return
        try:
            binding.library()  # the kernels first: the handlers' library links against them
            lib = ctypes.CDLL(ffi_library())
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _state["lib"] = lib  # keep the library loaded
            _state["ok"] = True
        except Exception as e:  # noqa: BLE001 - any build or registration failure is the reason
            _state["error"] = f"{type(e).__name__}: {e}"


def unavailable_reason() -> str | None:
    """None when the FFI targets are registered (or register now); else why they cannot run here."""
    _register()
    return _state.get("error")


def require(backend: str = "cpu") -> None:
    """Raise BackendUnavailableError (saying why) when the FFI targets cannot run here."""
    if (reason := unavailable_reason()) is not None:
        raise backend_unavailable(backend, reason)


DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def dtype_unavailable(dtype) -> str | None:
    """None when the kernel takes q of this dtype, else why not."""
    if jnp.dtype(dtype) in DTYPES:
        return None
    return f"the C kernel takes bfloat16 or float32 inputs, got {jnp.dtype(dtype)} (float16 runs backend='xla')"


def no_backward(impl, what: str):
    """`impl` with a backward that raises: an FFI call has no derivative rule, and a gradient
    must never silently be wrong or zero."""
    f = jax.custom_vjp(impl)

    def fwd(*args):
        return impl(*args), None

    def bwd(_, g):
        raise NotImplementedError(f"{what}: backend='cpu' (the C kernel, an XLA FFI call) has no backward pass")

    f.defvjp(fwd, bwd)
    return f
