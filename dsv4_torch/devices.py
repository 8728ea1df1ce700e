"""Whether a kernel family can run on a torch device: the probing `dsv4_torch.kvcache` (and the
sparse-attention resolver's rules) rest on. Host-side checks only (no device sync). Also whether
torch's own bf16 matmuls are emulated on this CPU (`emulated_bf16_gemm`), and the one-time warning
the model-level entry points give then (`warn_emulated_bf16_gemm`)."""

from __future__ import annotations

import functools
import warnings

import torch


@functools.cache
def triton_import_error() -> str | None:
    """None if Triton imports, else why not (checked once per process)."""
    try:
        import triton  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"cannot import triton ({type(e).__name__}: {e})"
    return None


def triton_unavailable(device: torch.device, *, interpreted: bool, module: str) -> str | None:
    """None if the Triton kernels of `module` (interpreted: whether it was imported under
    TRITON_INTERPRET=1) can run on tensors on `device`: CUDA/ROCm, or CPU when interpreted."""
    if (err := triton_import_error()) is not None:
        return err
    if device.type == "cuda" or (device.type == "cpu" and interpreted):
        return None
    return (
        f"tensors on {device}: Triton kernels need CUDA/ROCm tensors, or CPU tensors with "
        f"TRITON_INTERPRET=1 set before {module} is first imported"
    )


def cpu_unavailable(device: torch.device, unavailable_reason) -> str | None:
    """None if a C kernel for CPU tensors can run on `device`; `unavailable_reason()` says whether
    it was built (called only for CPU devices)."""
    if device.type != "cpu":
        return f"tensors on {device}: the cpu backend reads CPU tensors"
    return unavailable_reason()


# ----------------------------------------------------------------------------- bf16 GEMM on CPUs

_BF16_WARNED: set[str] = set()


@functools.cache
def _bf16_matmul_native() -> bool:
    from dsv4_cpu.binding import bf16_matmul_native  # noqa: PLC0415 - reads /proc/cpuinfo once

    return bf16_matmul_native()


def emulated_bf16_gemm(dtype: torch.dtype, device) -> bool:
    """Whether torch's matmuls on `dtype` tensors on `device` run emulated: bfloat16 on a CPU
    without AVX512-BF16 or AMX-BF16 (`dsv4_cpu.binding.bf16_matmul_native`), where torch's 2048^3
    bf16 matmul runs at about 0.3 GFLOP/s against 130 for float32 (AMD EPYC Zen 3)."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not _bf16_matmul_native()


def warn_emulated_bf16_gemm(dtype: torch.dtype, device, what: str) -> bool:
    """Warn once per process and `what` (RuntimeWarning) when `what` will run torch's matmuls in
    emulated bfloat16 (`emulated_bf16_gemm`); returns whether it will."""
    if not emulated_bf16_gemm(dtype, device):
        return False
    if what not in _BF16_WARNED:
        _BF16_WARNED.add(what)
        warnings.warn(
            f"{what}: bfloat16 on a CPU without AVX512-BF16 or AMX-BF16, so torch's bf16 matmuls (the model's "
            "projections) are emulated here, hundreds of times slower than float32 (2048^3: 0.3 against 130 "
            "GFLOP/s on a Zen 3); load the model in float32 on this machine (dsv4's attention and indexer "
            "kernels take bfloat16 at float32 speed, torch's linear layers do not)",
            RuntimeWarning,
            stacklevel=3,
        )
    return True
