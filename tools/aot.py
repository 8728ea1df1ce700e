"""Lower JAX programs for CUDA on a machine without a GPU (CI catches Triton-lowering errors).

jax 0.10 lowers a Pallas-Triton call for CUDA from any machine; jax >= 0.11 also asks which GPU
to target, through an abstract mesh carrying an `AbstractDevice`. `lower_for_cuda` hides the
difference. `triton_ir` returns the Triton IR that Pallas emits for the sparse-attention kernel,
which `tools.triton_compile.compile_ttir` compiles offline with the `triton` wheel.

Used by tests (`tests/jax/test_sparse_attention.py`, `tests/jax/test_prefill.py`) and by
`bench/checks/triton_resources_jax.py`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

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


def kernel_arg_specs(T: int, H: int, D: int, S: int, K: int):
    """Abstract bf16 inputs of one sparse-attention kernel call: q (T, H, D), kv (S, D),
    indices (T, K) int32, sink (H,) float32, topk_length (T,) int32."""
    return (
        jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((S, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((T, K), jnp.int32),
        jax.ShapeDtypeStruct((H,), jnp.float32),
        jax.ShapeDtypeStruct((T,), jnp.int32),
    )


def triton_ir(T: int, H: int, D: int, S: int, K: int, tiling: dict) -> str:
    """The Triton MLIR text Pallas emits for one kernel call (CUDA lowering, no GPU needed).

    `tiling`: the keyword arguments block_h, block_k, block_dv, num_warps, num_stages of
    `sparse_attention_pallas`. Reads the module from a jax-internal hook (pinned jax versions).
    """
    from jax._src.pallas.triton import pallas_call_registration as registration

    from dsv4_jax.kernels.triton.attention import sparse_attention_pallas

    captured = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:

        def f(q, kv, idx, sink, topk_length):
            return sparse_attention_pallas(q, kv, idx, D**-0.5, sink, topk_length, interpret=False, **tiling)

        lower_for_cuda(f, *kernel_arg_specs(T, H, D, S, K))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
    if len(captured) != 1:
        raise RuntimeError(f"triton_ir: expected one Triton module from the lowering, got {len(captured)}")
    return captured[0]
