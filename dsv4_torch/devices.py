"""Whether a kernel family can run on a torch device: the probing `dsv4_torch.kvcache` (and the
sparse-attention resolver's rules) rest on. Host-side checks only (no device sync)."""

from __future__ import annotations

import functools

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
