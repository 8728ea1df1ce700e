"""Where a JAX call runs and whether a kernel family can run there: the device probing that
`dsv4_jax.kvcache` (and the sparse-attention resolver's rules) rest on.

The devices of a call are those of its concrete, committed input arrays; without any (tracers,
uncommitted arrays) JAX's default device, which is where a jitted call runs. Everything here is
host-side metadata (no device sync); per-device answers are cached.
"""

from __future__ import annotations

import functools

import jax


def default_device():
    """Where a computation on uncommitted or traced arrays runs: jax.default_device, else the
    first device of the default backend."""
    default = jax.config.jax_default_device
    if isinstance(default, str):
        return jax.devices(default)[0]
    return default if default is not None else jax.devices()[0]


def committed_devices(arrays) -> set:
    """Devices of the concrete, committed arrays among `arrays` (tracers and uncommitted arrays
    follow the default device, so they do not count)."""
    devices = set()
    for x in arrays:
        if not isinstance(x, jax.Array):
            continue
        try:
            if x.committed:
                devices |= set(x.devices())
        except jax.errors.ConcretizationTypeError:  # a tracer: placement decided by the caller's jit
            continue
    return devices


def devices_for(arrays) -> list:
    """The devices a call on `arrays` runs on, in a stable order: the committed ones, else the
    default device ([] only on a JAX without devices)."""
    devices = committed_devices(arrays)
    if devices:
        return sorted(devices, key=lambda d: (d.platform, d.id))
    try:
        return [default_device()]
    except RuntimeError:  # pragma: no cover - broken installs
        return []


def platforms(arrays) -> set[str]:
    """The platforms ("cpu", "gpu", ...) of `devices_for(arrays)`."""
    devices = devices_for(arrays)
    return {d.platform for d in devices} if devices else {jax.default_backend()}


@functools.cache
def nvidia_gpu_unavailable(device) -> str | None:
    """None if Pallas kernels lowered through Triton can run on `device` (an NVIDIA GPU of compute
    capability >= 8.0), else the reason."""
    if device.platform != "gpu":
        return f"needs an NVIDIA GPU, but the device is {device.platform} ({device.device_kind})"
    version = str(getattr(device.client, "platform_version", "")).lower()
    if "rocm" in version or "hip" in version:
        return f"needs an NVIDIA GPU, but the GPU runtime is {version}"
    capability = getattr(device, "compute_capability", None)
    if capability is not None and float(capability) < 8.0:
        return f"needs compute capability >= 8.0 (bf16 MMA), got {capability} on {device.device_kind}"
    return None


def triton_unavailable(arrays) -> str | None:
    """None if the Pallas -> Triton kernels can run on every device of a call on `arrays`, else
    the first reason."""
    devices = devices_for(arrays)
    if not devices:
        return "JAX found no device"
    reasons = [r for r in map(nvidia_gpu_unavailable, devices) if r]
    return reasons[0] if reasons else None
