"""Lower JAX programs for CUDA on a machine without a GPU (CI catches Triton-lowering errors).

jax 0.10 lowers a Pallas-Triton call for CUDA from any machine; jax >= 0.11 also asks which GPU
to target, through an abstract mesh carrying an `AbstractDevice`. `lower_for_cuda` hides the
difference.
"""

from __future__ import annotations

import contextlib

import jax

DEFAULT_TARGET = "NVIDIA H100"  # any kind jax's Pallas GPU registry knows (H100, H200, B200, ...)


def cuda_target(device_kind: str = DEFAULT_TARGET):
    """A context in which lowering for CUDA targets `device_kind` (a no-op on jax 0.10)."""
    sharding = jax.sharding
    if not hasattr(sharding, "AbstractDevice") or not hasattr(sharding, "use_abstract_mesh"):
        return contextlib.nullcontext()
    device = sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = sharding.AbstractMesh((1,), ("aot",), abstract_device=device)
    return sharding.use_abstract_mesh(mesh)


def lower_for_cuda(fn, *args, device_kind: str = DEFAULT_TARGET):
    """`jax.jit(fn)` traced on `args` (arrays or ShapeDtypeStructs) and lowered for CUDA."""
    with cuda_target(device_kind):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
