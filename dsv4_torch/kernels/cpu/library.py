"""The backend "cpu" for torch, its library: the C/C++ kernels of `dsv4_cpu` loaded through the
ctypes binding, with torch's parallel-for runner, and the small argument helpers the backend's
calls share (`attention`, `kvcache`, `indexer`, `prefill` of this folder).

Every call runs on torch's own intra-op threads (`at::parallel_for`, through the small
`torch_parallel.cc` library built against the installed torch, compiled with -fopenmp and bound
to torch's own libgomp), so the kernels never compete with torch's OpenMP threads for the cores.
Threads: `torch.get_num_threads()`. Instruction set: the best this machine runs
(`dsv4_cpu.isa_supported()`), capped by `DSV4_PREFILL_CPU_ISA=generic|avx2|avx512|avx512bf16`.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from dsv4_cpu import binding, build
from planner.contract import backend_unavailable

DTYPES = {torch.bfloat16: binding.BF16, torch.float32: binding.F32}

_lock = threading.Lock()
_state: dict = {}


def torch_parallel_library() -> str:
    """The path of torch's parallel-for library for this torch (built on first use)."""
    root = os.path.dirname(os.path.abspath(torch.__file__))
    include = (os.path.join(root, "include"), os.path.join(root, "include", "torch", "csrc", "api", "include"))
    return build.build_torch(
        include, os.path.join(root, "lib"), bool(torch._C._GLIBCXX_USE_CXX11_ABI), torch.__version__
    )


def runner() -> int:
    """The address of `dsv4_torch_parallel_run` (at::parallel_for), loaded once."""
    with _lock:
        if "run" not in _state:
            if "error" in _state:
                raise RuntimeError(_state["error"])
            try:
                binding.library()
                lib = ctypes.CDLL(torch_parallel_library())
                _state["lib"] = lib  # kept loaded
                _state["run"] = ctypes.cast(lib.dsv4_torch_parallel_run, ctypes.c_void_p).value
            except Exception as e:  # noqa: BLE001 - any build or load failure is the reason
                _state["error"] = f"{type(e).__name__}: {e}"
                raise RuntimeError(_state["error"]) from None
        return _state["run"]


def unavailable_reason() -> str | None:
    """None when the kernels and torch's parallel-for build (or are built) here, else why not."""
    try:
        runner()
    except RuntimeError as e:
        return str(e)
    return None


def library():
    try:
        runner()
        return binding.library()
    except RuntimeError as e:
        raise backend_unavailable("cpu", str(e)) from None


def parallel(threads: int | None) -> binding.Parallel:
    return binding.parallel(int(threads or torch.get_num_threads()), runner())


def dtype_code(q: torch.Tensor) -> int:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.device.type != "cpu":
        raise ValueError(f"q: the cpu backend takes CPU tensors, q is on {q.device}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q: the cpu backend takes bfloat16 or float32, got {q.dtype}")
    return DTYPES[q.dtype]


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (any other strides are passed on), else a copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def float_sink(attn_sink: torch.Tensor | None) -> torch.Tensor | None:
    if attn_sink is None or (attn_sink.dtype == torch.float32 and attn_sink.is_contiguous()):
        return attn_sink  # (only its memory is read)
    return attn_sink.detach().to(torch.float32).contiguous()


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def make_outputs(out: torch.Tensor, max_logits: torch.Tensor | None, lse: torch.Tensor | None) -> binding.Outputs:
    stat = max_logits if max_logits is not None else lse
    return binding.Outputs(
        out.data_ptr(), out.stride(0), out.stride(1), ptr(max_logits), ptr(lse), 0 if stat is None else stat.stride(0)
    )


def check_cpu(t: torch.Tensor | None, name: str) -> None:
    if t is not None and t.device.type != "cpu":
        raise ValueError(f"{name}: the cpu backend takes CPU tensors, {name} is on {t.device}")
