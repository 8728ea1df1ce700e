"""`dsv4_jax.sparse_attention`: the FlashMLA sparse-attention contract on `jax.Array`s.

One entry point, seven concrete backends behind it:
  "mosaic_gpu"       the Mosaic GPU kernel (`dsv4_jax.kernels.mosaic`): Hopper (SM90) GPUs,
                     jax >= 0.12, bf16, H in {16, 32, 64, 128}, D in {512, 576},
  "mosaic_interpret" the same kernel run by Mosaic GPU's interpret mode (CPU; jax >= 0.12; slow),
  "pallas_triton"    the Pallas kernel compiled by Triton (NVIDIA GPUs, compute capability >= 8.0),
  "pallas_interpret" the same kernel run by Pallas' interpreter (any platform; slow, for tests),
  "cpu"              the C kernel of `planner/csrc` as an XLA FFI call (`dsv4_jax.kernels.
                     cpu_attention`): CPU arrays, bf16 or float32, built on first use with the
                     system compilers; no backward (a gradient through it raises),
  "xla"              the plain-jnp reference (any platform; fp32 math, tiled, deterministic).
  "mosaic_tpu"       the Pallas TPU kernel (`dsv4_jax.kernels.mosaic_tpu`): TPU devices, bf16 or
                     float32; `interpret=True` runs it in TPU interpret mode anywhere (slow).
Requested names: "auto" (mosaic_tpu on TPU devices for bf16 / float32; mosaic_gpu on an SM90 GPU with jax >= 0.12 for the inputs it serves,
else pallas_triton on an NVIDIA GPU; on the CPU, cpu for bf16 / float32 where the C kernel
builds; else xla), "mosaic" (mosaic_gpu on an SM90 GPU, else mosaic_interpret where there is
no NVIDIA GPU), "pallas" (pallas_triton on an NVIDIA GPU, else pallas_interpret), or one of the
six above. A named backend that cannot run raises `BackendUnavailableError` saying why (never a
silent switch). `resolve_backend` says which one a request runs, `available_backends` says which
can run here and why not, and every trace logs the choice at DEBUG level on the "dsv4_jax"
logger. The choice follows the devices of committed input arrays (CPU arrays run "auto" on cpu,
or xla, even where a GPU exists), else JAX's default device.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import devices
from dsv4_jax.kernels import cpu_attention, mosaic_tpu
from dsv4_jax.kernels import mosaic as mosaic_kernel
from dsv4_jax.kernels.pallas_triton import sparse_attention_pallas
from dsv4_jax.kernels.xla import sparse_attention_xla
from planner.checks import sm_scale_value, sparse_attention_shapes
from planner.contract import BACKENDS as CONTRACT_BACKENDS  # noqa: F401  (re-exported)
from planner.contract import backend_unavailable

logger = logging.getLogger("dsv4_jax")

BACKENDS = CONTRACT_BACKENDS["jax"]  # "pallas" / "mosaic" resolve to a concrete backend per device
CONCRETE_BACKENDS = tuple(b for b in BACKENDS if b not in ("pallas", "mosaic"))
REQUESTABLE_BACKENDS = ("auto",) + BACKENDS
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _pallas_triton_unavailable() -> str | None:
    """None if the Pallas->Triton path can run on JAX's default device, else the reason (the seam
    tests use to pretend a capable GPU)."""
    return devices.pallas_triton_unavailable(())


def _triton_unavailable_for(arrays) -> str | None:
    if devices.committed_devices(arrays):
        return devices.pallas_triton_unavailable(arrays)
    return _pallas_triton_unavailable()


def _mosaic_device_unavailable(device) -> str | None:
    """None if the compiled Mosaic GPU kernel can run on `device`, else the reason."""
    if (reason := devices.nvidia_gpu_unavailable(device)) is not None:
        return reason
    capability = getattr(device, "compute_capability", None)
    if capability is not None and str(capability) != "9.0":
        return f"is a Hopper (SM90, wgmma) kernel, got compute capability {capability} on {device.device_kind}"
    return None


def _mosaic_gpu_unavailable_for(arrays) -> str | None:
    if (reason := mosaic_kernel.unavailable_reason()) is not None:
        return reason
    reasons = [r for r in map(_mosaic_device_unavailable, devices.devices_for(arrays)) if r]
    return reasons[0] if reasons else None


def _mosaic_interpret_unavailable() -> str | None:
    return mosaic_kernel.unavailable_reason()


def _cpu_unavailable_for(arrays, q=None) -> str | None:
    """None if the C kernel can run on `arrays`' devices (and q's dtype, when given), else why."""
    platforms = sorted({d.platform for d in devices.devices_for(arrays)})
    if platforms != ["cpu"]:
        return f"runs on CPU arrays, but the arrays are on {platforms or 'no device'}"
    if q is not None and getattr(q, "dtype", None) is not None:
        if (reason := cpu_attention.dtype_unavailable(q.dtype)) is not None:
            return reason
    return cpu_attention.unavailable_reason()


def _on_nvidia_gpu(arrays) -> bool:
    return any(devices.nvidia_gpu_unavailable(d) is None for d in devices.devices_for(arrays))


def available_backends(*arrays) -> dict[str, str | None]:
    """Concrete backend name -> None if it can run here (on `arrays`' devices when given and
    committed, else on the default device), else the reason it cannot. (mosaic_gpu also takes
    only the shapes and dtype in the module docstring, cpu only bf16 and float32;
    `resolve_backend` checks those per call.)"""
    return {
        "xla": None,
        "cpu": _cpu_unavailable_for(arrays),
        "pallas_triton": _triton_unavailable_for(arrays),
        "pallas_interpret": None,
        "mosaic_gpu": _mosaic_gpu_unavailable_for(arrays),
        "mosaic_interpret": _mosaic_interpret_unavailable(),
        "mosaic_tpu": _mosaic_tpu_unavailable_for(arrays),
    }


def _mosaic_tpu_unavailable_for(arrays, interpret=False) -> str | None:
    """None if the Pallas TPU kernel can run (compiled: on TPU devices, or inside
    `mosaic_tpu.compile_target`; interpreted: anywhere Pallas TPU imports), else why not."""
    if interpret:
        return mosaic_tpu.unavailable_reason()
    if mosaic_tpu.compile_target_chip() is not None:
        return mosaic_tpu.unavailable_reason()  # compiling for a chosen TPU from here
    platforms = sorted({d.platform for d in devices.devices_for(arrays)})
    if platforms != ["tpu"]:
        return (
            f"compiles for TPU arrays, but the arrays are on {', '.join(platforms) or 'no device'}; pass "
            "interpret=True to run it in TPU interpret mode, or compile for a chip inside "
            "dsv4_jax.kernels.mosaic_tpu.compile_target"
        )
    return mosaic_tpu.unavailable_reason()


def _on_tpu(arrays, q) -> bool:
    if {d.platform for d in devices.devices_for(arrays)} != {"tpu"}:
        return False
    return q is None or getattr(q, "dtype", None) is None or jnp.dtype(q.dtype) in mosaic_tpu.DTYPES


def _mosaic_serves(q) -> bool:
    """Whether the Mosaic kernel takes q's dtype and shape (True when q is not given)."""
    if q is None or getattr(q, "shape", None) is None:
        return True
    if jnp.dtype(q.dtype) != jnp.bfloat16 or jnp.ndim(q) != 3:
        return False
    return q.shape[1] in mosaic_kernel.HEADS and q.shape[2] in mosaic_kernel.HEAD_DIMS


def resolve_backend(backend: str = "auto", *arrays, interpret=False) -> str:
    """The concrete backend (one of `CONCRETE_BACKENDS`) a request runs.

    The choice follows the devices of `arrays` when some are concrete and committed (e.g.
    CPU arrays while a GPU exists run "auto" on cpu); otherwise JAX's default device, which is
    where a jitted call on traced or uncommitted arrays runs. When the first array is q, "auto"
    takes mosaic_gpu only for the dtype and shapes that kernel serves (bf16, H in {16, 32, 64,
    128}, D in {512, 576}); others go to pallas_triton. On the CPU, "auto" takes cpu for bf16
    and float32 q (or no q) where the C kernel builds, else xla (float16 always).

    On TPU devices "auto" takes mosaic_tpu (bf16 / float32 q; else xla). `interpret` (True or a
    `pltpu.InterpretParams`) is an option of "mosaic_tpu" only: its TPU interpret mode, anywhere.

    Raises ValueError for an unknown name and `BackendUnavailableError` (a RuntimeError), with
    the reason, for a named backend that cannot run on those devices.
    """
    if backend not in REQUESTABLE_BACKENDS:
        raise ValueError(f"backend: expected one of {REQUESTABLE_BACKENDS}, got {backend!r}")
    q = arrays[0] if arrays else None
    if interpret is not False and interpret is not None:
        if backend != "mosaic_tpu":
            raise ValueError(
                f"interpret: an option of backend='mosaic_tpu' only, got backend={backend!r} "
                "(the GPU kernels' interpreters are 'pallas_interpret' and 'mosaic_interpret')"
            )
        if (reason := _mosaic_tpu_unavailable_for(arrays, interpret=True)) is not None:
            raise backend_unavailable("mosaic_tpu", reason)
        return "mosaic_tpu"
    if backend == "mosaic_tpu":
        if (reason := _mosaic_tpu_unavailable_for(arrays)) is not None:
            raise backend_unavailable("mosaic_tpu", reason)
        return "mosaic_tpu"
    if backend == "auto" and _on_tpu(arrays, q):
        return "mosaic_tpu"
    triton_missing = _triton_unavailable_for(arrays)
    if backend == "auto":
        if not triton_missing and _mosaic_serves(q) and _mosaic_gpu_unavailable_for(arrays) is None:
            return "mosaic_gpu"
        if triton_missing:
            return "cpu" if _cpu_unavailable_for(arrays, q) is None else "xla"
        return "pallas_triton"
    if backend == "cpu":
        if (reason := _cpu_unavailable_for(arrays, q)) is not None:
            raise backend_unavailable("cpu", reason)
        return "cpu"
    if backend == "pallas":
        return "pallas_interpret" if triton_missing else "pallas_triton"
    if backend == "mosaic":
        # An NVIDIA GPU that cannot run the kernel (not SM90) is an error, not a quiet
        # interpreter run; without an NVIDIA GPU the kernel runs interpreted.
        backend = "mosaic_interpret" if triton_missing else "mosaic_gpu"
    if backend == "pallas_triton" and triton_missing:
        raise backend_unavailable("pallas_triton", triton_missing)
    if backend == "mosaic_gpu" and (reason := _mosaic_gpu_unavailable_for(arrays)):
        raise backend_unavailable("mosaic_gpu", reason)
    if backend == "mosaic_interpret" and (reason := _mosaic_interpret_unavailable()):
        raise backend_unavailable("mosaic_interpret", reason)
    return backend


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
      backend: "auto", "mosaic", "pallas" or one of `CONCRETE_BACKENDS` (module docstring).
        The Mosaic kernel takes bf16 only, H in {16, 32, 64, 128} and D in {512, 576}; other
        inputs named for it raise ValueError. "cpu" takes bf16 and float32 (float16 named for it
        raises BackendUnavailableError) and has no backward: a gradient through it raises
        NotImplementedError. "mosaic_tpu" takes bf16 and float32.
      interpret: backend "mosaic_tpu" only: True or a `pltpu.InterpretParams` runs the TPU kernel
        in TPU interpret mode (CPU; slow); False compiles it (a TPU is needed).

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
    concrete = resolve_backend(backend, q, kv, indices, interpret=interpret)
    logger.debug(
        "sparse_attention: backend %r -> %s (T=%d H=%d D=%d S=%d K=%d %s)",
        backend,
        concrete,
        *q.shape,
        kv.shape[0],
        indices.shape[1],
        jnp.dtype(q.dtype).name,
    )
    if concrete == "xla":
        return sparse_attention_xla(q, kv, indices, sm_scale, attn_sink, topk_length)
    if concrete == "cpu":
        return cpu_attention.sparse_attention(q, kv, indices, sm_scale, attn_sink, topk_length)
    if concrete == "mosaic_tpu":
        return mosaic_tpu.sparse_attention_mosaic_tpu(
            q, kv, indices, sm_scale, attn_sink, topk_length, interpret=interpret or False
        )
    if concrete in ("mosaic_gpu", "mosaic_interpret"):
        return mosaic_kernel.sparse_attention_mosaic(
            q, kv, indices, sm_scale, attn_sink, topk_length, interpret=(concrete == "mosaic_interpret")
        )
    return sparse_attention_pallas(
        q, kv, indices, sm_scale, attn_sink, topk_length, interpret=(concrete == "pallas_interpret")
    )
