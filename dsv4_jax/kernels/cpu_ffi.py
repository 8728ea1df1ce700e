"""dsv4-prefill's CPU kernels (`planner/csrc`) as XLA FFI custom calls: one build, one registration.

The handlers (`dsv4_jax/kernels/csrc/cpu_ffi.cc`) are compiled with the kernels into their own
copy of the library (`planner.ckernel.build_library`, against jaxlib's FFI headers) and registered
once per process as custom-call targets on the CPU platform: the fp8_ds_mla gathers
(`cpu_kvcache`) and the sparse-attention backend "cpu" (`cpu_attention`). Where the library
cannot be built, `unavailable_reason()` says why and the callers keep their xla paths.
"""

from __future__ import annotations

import ctypes
import os
import threading

import jax

from planner import ckernel
from planner.contract import backend_unavailable

FFI_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "cpu_ffi.cc")
# custom-call target -> handler symbol in the library
TARGETS = {
    "dsv4_gather_dequant": "Dsv4GatherDequant",
    "dsv4_gather_segments": "Dsv4GatherSegments",
    "dsv4_sparse_attention": "Dsv4SparseAttention",
    "dsv4_prefill_attention": "Dsv4PrefillAttention",
    "dsv4_prefill_attention_into": "Dsv4PrefillAttentionInto",
}

_lock = threading.Lock()
_state: dict = {}


def _register() -> None:
    with _lock:
        if "ok" in _state or "error" in _state:
            return
        try:
            lib = ctypes.CDLL(ckernel.build_library("dsv4_cpu_jax", (FFI_SOURCE,), (jax.ffi.include_dir(),)))
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


def threads() -> int:
    """Threads one call may use: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
