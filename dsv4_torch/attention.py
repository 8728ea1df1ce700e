"""`sparse_attention`: the FlashMLA sparse-attention contract (spec section 2) on four backends.

- "flashmla": the FlashMLA wheel, SM90/SM100 GPUs, bf16, D in {512, 576}.
- "triton": our Triton kernel, any CUDA/ROCm GPU (CPU tensors under TRITON_INTERPRET=1).
- "cpu": our C/C++ kernel (`dsv4_cpu`, built once per machine with the system compiler),
  CPU tensors, bf16 / float32, any H and D; instruction set chosen at run time.
- "reference": tiled plain torch, any device, bitwise tile invariant.
- "auto": flashmla if it can serve the call, else triton on a GPU; on CPU "cpu" for bf16 /
  float32 where the kernel builds; else reference.

Gradients: only the reference backend has a backward (`kernels/reference.py`, recomputed per
tile). Whenever a gradient is required (grad mode on and q, kv or attn_sink requires grad),
"auto" resolves to "reference" and a named "triton" / "flashmla" / "cpu" raises
`BackendUnavailableError`; a gradient is never dropped. The same holds for attention dropout.

This module validates arguments and dispatches; the backends' table (what each serves, why it
cannot run, how it runs) is `dsv4_torch.backends`; the kernels live in `dsv4_torch/kernels/`.
"""

from __future__ import annotations

import logging
import numbers

import torch

from dsv4_torch.backends import BACKENDS, available_backends, resolve_backend, run_backend  # noqa: F401
from planner.checks import sm_scale_value, sparse_attention_shapes

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MQA attention over a flat KV workspace (FlashMLA `flash_mla_sparse_fwd` contract).

    Args:
      q: (T, H, D), bfloat16 / float16 / float32 / float64.
      kv: (S, D) or (S, 1, D), q.dtype. K = V = the row; V is its first d_v dims
        (d_v = 512 if D >= 512 else D, `planner.contract.value_dim`).
      indices: (T, K) or (T, 1, K), int32. An entry is invalid if it is negative, >= S, or at a
        column >= topk_length[t]. Duplicated indices count once per occurrence.
      sm_scale: float (or a 0-d CPU tensor), finite: the logit is sm_scale * <q[t, h], kv[i]>.
        A tensor on a GPU raises TypeError: reading it would make the host wait for the device.
      attn_sink: optional (H,), float32 (or float64): a per-head logit that joins the softmax
        denominator only, scaling out by exp(lse) / (exp(lse) + exp(sink)). -inf = no sink.
      topk_length: optional (T,), int32: only columns < topk_length[t] are read.
      backend: "auto", "flashmla", "triton", "cpu" or "reference" (see `resolve_backend`).
      dropout_p: attention dropout in [0, 1), transformers' eager semantics: each probability
        (the sink's excluded) is zeroed with probability p, the kept ones scaled by 1 / (1 - p);
        the mask comes from torch's default CPU generator (so `torch.manual_seed` and checkpoint
        recomputation reproduce it). Reference backend only; 0 (the default) = the exact kernel.

    Returns:
      out: (T, H, d_v), q.dtype; 0 for rows with no valid key.
      max_logits: (T, H), float32 (float64 for float64 q on the reference backend);
        max valid logit, -inf if none.
      lse: (T, H), same dtype: natural-log sum-exp of the valid logits, sink excluded; +inf if none.

    Accumulation is float32 for 16-bit and float32 inputs. Differentiable on the reference
    backend (out and lse; see the module doc); the other backends refuse a call that needs a
    gradient. Non-contiguous inputs are accepted: the reference backend reads any strides, the GPU
    backends copy such inputs to contiguous first (a copy, never a wrong answer), the cpu backend
    reads any strides but copies an input whose last dim is not contiguous.

    Raises:
      TypeError / ValueError naming the argument for bad dtypes, shapes, devices or values;
      BackendUnavailableError if the named backend cannot run here.
    """
    q, kv, indices, sm_scale, attn_sink, topk_length = _validate(q, kv, indices, sm_scale, attn_sink, topk_length)
    dropout_p = check_dropout(dropout_p)
    grad = gradient_required(q, kv, attn_sink)
    name = resolve_backend(backend, q, needs_grad=grad, dropout_p=dropout_p)
    logger.debug(
        "sparse_attention: backend=%s (asked %r) T=%d H=%d D=%d K=%d dtype=%s device=%s grad=%s",
        name,
        backend,
        q.shape[0],
        q.shape[1],
        q.shape[2],
        indices.shape[1],
        q.dtype,
        q.device,
        grad,
    )
    return run_backend(name, q, kv, indices, sm_scale, attn_sink, topk_length, grad=grad, dropout_p=dropout_p)


def gradient_required(*tensors) -> bool:
    """Grad mode is on and one of the tensors (None allowed) requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _validate(q, kv, indices, sm_scale, attn_sink, topk_length):
    """Check every argument; return (q, kv (S, D), indices (T, K), float scale, sink, topk_length).

    Types, dtypes and devices here; shapes and sm_scale's value by `planner.checks` (the rules and
    wording torch, JAX and the oracle share)."""
    for name, t in (("q", q), ("kv", kv), ("indices", indices), ("attn_sink", attn_sink), ("topk_length", topk_length)):
        if t is not None or name not in ("attn_sink", "topk_length"):
            _need_tensor(t, name)
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q: expected bfloat16, float16, float32 or float64, got {q.dtype}")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv: dtype {kv.dtype} does not match q's dtype {q.dtype}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices: expected int32, got {indices.dtype}")
    if attn_sink is not None and attn_sink.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"attn_sink: expected float32 (or float64), got {attn_sink.dtype}")
    if topk_length is not None and topk_length.dtype != torch.int32:
        raise TypeError(f"topk_length: expected int32, got {topk_length.dtype}")
    sink_shape = None if attn_sink is None else attn_sink.shape
    shapes = sparse_attention_shapes(
        q.shape, kv.shape, indices.shape, sink_shape, None if topk_length is None else topk_length.shape
    )
    kv = kv[:, 0] if shapes.squeeze_kv else kv
    indices = indices[:, 0] if shapes.squeeze_indices else indices
    sm_scale = check_sm_scale(sm_scale)

    for name, t in (("kv", kv), ("indices", indices), ("attn_sink", attn_sink), ("topk_length", topk_length)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: on device {t.device}, but q is on {q.device}")
    return q, kv, indices, sm_scale, attn_sink, topk_length


def check_sm_scale(sm_scale) -> float:
    """sm_scale as a finite float (a float, or a 0-d CPU tensor); raises naming it otherwise."""
    if isinstance(sm_scale, torch.Tensor):
        # Reading a device tensor on the host would wait for the GPU on every call.
        if sm_scale.ndim != 0 or sm_scale.device.type != "cpu":
            raise TypeError(
                f"sm_scale: pass a float (or a 0-d CPU tensor), got a tensor of shape {tuple(sm_scale.shape)} "
                f"on {sm_scale.device}"
            )
        sm_scale = sm_scale.item()
    return sm_scale_value(sm_scale)


def check_sink(attn_sink, H: int, device: torch.device | None = None) -> None:
    """attn_sink is None or an (H,) float32/float64 tensor (on `device` when given)."""
    if attn_sink is None:
        return
    _need_tensor(attn_sink, "attn_sink")
    if attn_sink.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"attn_sink: expected float32 (or float64), got {attn_sink.dtype}")
    if tuple(attn_sink.shape) != (H,):
        raise ValueError(f"attn_sink: expected shape ({H},) (one logit per head), got {tuple(attn_sink.shape)}")
    if device is not None and attn_sink.device != device:
        raise ValueError(f"attn_sink: on device {attn_sink.device}, but q is on {device}")


def _need_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
