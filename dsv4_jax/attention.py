"""`dsv4_jax.sparse_attention`: the FlashMLA sparse-attention contract on `jax.Array`s.

One entry point; the kernels behind it and how one is chosen are the table in
`dsv4_jax.backends`: "xla" (plain jnp, any platform), "cpu" (our C kernel as XLA FFI calls, CPU
arrays, bf16 / float32, no backward), "triton" (a Pallas kernel lowered through Triton, NVIDIA
GPUs), "mosaic_gpu" (a Pallas Mosaic GPU kernel, Hopper, jax >= 0.12). `interpret=True` runs a
Pallas kernel in its interpreter on any platform (tests). "auto" picks by device, dtype and
shape; `resolve_backend` says which one a request runs, `available_backends` which can run here
and why not, and every trace logs the choice at DEBUG level on the "dsv4_jax" logger.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.backends import BACKENDS, available_backends, resolve_backend, run_backend  # noqa: F401
from planner.checks import sm_scale_value, sparse_attention_shapes

logger = logging.getLogger("dsv4_jax")

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _dtype_of(x, name: str) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    return jnp.dtype(dtype)


def _check_static_float(sm_scale) -> float:
    if isinstance(sm_scale, jax.core.Tracer):
        raise TypeError("sm_scale: must be a concrete Python float (a compile-time constant), got a traced value")
    if isinstance(sm_scale, (jax.Array, np.ndarray)) and sm_scale.ndim == 0:
        sm_scale = sm_scale.item()  # a concrete 0-d array: its value
    return sm_scale_value(sm_scale)


def check_inputs(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    """Validate static shapes and dtypes; return the inputs in canonical form.

    Canonical form: q (T, H, D), kv (S, D), indices (T, K) int32, sm_scale a Python float,
    attn_sink (H,) float32 or None, topk_length (T,) int32 or None. Works on tracers. Dtypes
    here; shapes and sm_scale's value by `planner.checks` (the rules and wording torch, JAX and
    the oracle share).
    """
    for name, x in (("q", q), ("kv", kv)):
        if _dtype_of(x, name) not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {jnp.dtype(x.dtype)}")
    if jnp.dtype(kv.dtype) != jnp.dtype(q.dtype):
        raise TypeError(f"kv: dtype {jnp.dtype(kv.dtype)} does not match q's dtype {jnp.dtype(q.dtype)}")
    if _dtype_of(indices, "indices") != jnp.int32:
        raise TypeError(f"indices: expected int32, got {jnp.dtype(indices.dtype)} (cast with .astype(jnp.int32))")
    if attn_sink is not None and _dtype_of(attn_sink, "attn_sink").kind != "f":
        raise TypeError(f"attn_sink: expected a float array, got {jnp.dtype(attn_sink.dtype)}")
    if topk_length is not None and _dtype_of(topk_length, "topk_length") != jnp.int32:
        raise TypeError(f"topk_length: expected int32, got {jnp.dtype(topk_length.dtype)}")
    sink_shape = None if attn_sink is None else attn_sink.shape
    shapes = sparse_attention_shapes(
        q.shape, kv.shape, indices.shape, sink_shape, None if topk_length is None else topk_length.shape
    )
    if shapes.squeeze_kv:
        kv = jnp.reshape(kv, (shapes.S, shapes.D))
    if shapes.squeeze_indices:
        indices = jnp.reshape(indices, (shapes.T, shapes.K))
    sm_scale = _check_static_float(sm_scale)
    if attn_sink is not None:
        attn_sink = jnp.asarray(attn_sink, jnp.float32)
    if topk_length is not None:
        topk_length = jnp.asarray(topk_length)
    return jnp.asarray(q), jnp.asarray(kv), jnp.asarray(indices), sm_scale, attn_sink, topk_length


def sparse_attention(
    q, kv, indices, sm_scale, attn_sink=None, topk_length=None, *, backend: str = "auto", interpret=False
):
    """Sparse MQA attention over gathered KV rows (FlashMLA `flash_mla_sparse_fwd` contract).

    Args:
      q: (T, H, D), bfloat16 (float16 and float32 also accepted): query tokens.
      kv: (S, D) or (S, 1, D), same dtype as q: the flat workspace. K = V = the row; V is its
        first d_v dims, d_v = 512 if D >= 512 else D.
      indices: (T, K) or (T, 1, K), int32: workspace rows each token attends to. An entry is
        invalid if it is negative, >= S, or its column is >= topk_length[t]. Duplicates count
        each time.
      sm_scale: float, a compile-time constant: logits are sm_scale * <q, k>.
      attn_sink: (H,) float32 or None: one logit per head that joins the softmax denominator
        only; -inf means no sink.
      topk_length: (T,) int32 or None: columns >= topk_length[t] are invalid.
      backend: "auto" or one of `dsv4_jax.backends.ATTENTION` (module docstring). The Mosaic GPU
        kernel takes bf16 only, H in {16, 32, 64, 128} and D in {512, 576}; other shapes named
        for it raise ValueError, other dtypes TypeError. "cpu" takes bf16 and float32 (float16
        named for it raises TypeError) and has no backward: a gradient through it raises
        NotImplementedError.
      interpret: run a Pallas kernel ("triton", "mosaic_gpu") in its interpreter (any platform;
        slow, for tests): True, or the kernel's interpret parameters.

    Returns:
      out: (T, H, d_v), q.dtype: 0 for a token without a valid key; with a sink, scaled by
        exp(lse) / (exp(lse) + exp(sink)).
      max_logits: (T, H), float32: max logit over valid keys; -inf if none.
      lse: (T, H), float32: natural-log sum-exp of the logits, sink excluded; +inf if none.

    Accumulation is fp32 in every backend (bf16 inputs on "cpu": bf16 products, probabilities
    rounded to bf16 before P @ V, as FlashMLA). Usable under `jax.jit` (shapes and dtypes are
    checked at trace time; indices and lengths may be traced).
    """
    q, kv, indices, sm_scale, attn_sink, topk_length = check_inputs(q, kv, indices, sm_scale, attn_sink, topk_length)
    name = resolve_backend(backend, q, kv, indices, interpret=interpret)
    logger.debug(
        "sparse_attention: backend %r -> %s%s (T=%d H=%d D=%d S=%d K=%d %s)",
        backend,
        name,
        " (interpreted)" if interpret else "",
        *q.shape,
        kv.shape[0],
        indices.shape[1],
        jnp.dtype(q.dtype).name,
    )
    return run_backend(name, q, kv, indices, sm_scale, attn_sink, topk_length, interpret=interpret)
