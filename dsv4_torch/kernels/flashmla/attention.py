"""Sparse attention through the FlashMLA wheel (`sgl-flash-mla`, import `flash_mla`).

FlashMLA's `flash_mla_sparse_fwd` serves SM90 (Hopper) and SM100 (Blackwell datacenter) GPUs with
bf16 inputs, H in {64, 128}, D in {512, 576} and an index width that is a multiple of 128 on
SM90. This wrapper pads heads and index width to what the kernel takes and strips the padding.
The sgl-flash-mla wheel keeps the Hopper kernels as "legacy" ones behind `use_legacy=True`; the
wrapper passes it on SM90 when the installed `flash_mla_sparse_fwd` has that argument (upstream
FlashMLA's `flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)` has not).

`flash_mla` is imported lazily: importing it without an NVIDIA driver (or with a torch it was
not built for) fails, and that must not break `import dsv4_torch`.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

from planner.contract import D_V as FLASHMLA_D_V  # noqa: F401
from planner.contract import (
    FLASHMLA_HEAD_DIMS,
    FLASHMLA_HEADS,
    INDEX_ALIGN,
    BackendUnavailableError,
)

SUPPORTED_ARCH_MAJORS = (9, 10)  # SM90, SM100/SM103

_cache: dict[str, object] = {}


def load_flash_mla():
    """The `flash_mla_sparse_fwd` function, or raise RuntimeError saying why it is unavailable."""
    if "fn" not in _cache:
        try:
            import flash_mla  # noqa: PLC0415 - lazy on purpose

            _cache["fn"] = flash_mla.flash_mla_sparse_fwd
            _cache["error"] = None
        except Exception as e:  # ImportError, OSError (no libcuda), RuntimeError, undefined symbols
            _cache["fn"] = None
            _cache["error"] = f"cannot import flash_mla ({type(e).__name__}: {e}); install the sgl-flash-mla wheel"
    if _cache["fn"] is None:
        raise RuntimeError(_cache["error"])
    return _cache["fn"]


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """None if FlashMLA can run on `device` (default: the current CUDA device), else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.version.hip is not None:
        return "ROCm device (FlashMLA is NVIDIA-only)"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in SUPPORTED_ARCH_MAJORS:
        return f"needs an SM90/SM100 GPU, device is sm_{major}{minor}"
    try:
        load_flash_mla()
    except RuntimeError as e:
        return str(e)
    return None


def sparse_attention_flashmla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA sparse attention with heads and index width padded to what the kernel takes.

    Args:
      q: (T, H, D), bfloat16, CUDA (SM90/SM100); D in {512, 576}; any H (padded to 64/128,
        split into groups of 128 above that).
      kv: (S, D), bfloat16.
      indices: (T, K), int32. Entries that are negative, >= S, or at columns >= topk_length[t]
        are rewritten to -1 before the call, so the kernel only ever sees -1 as invalid.
      sm_scale: float.
      attn_sink: optional (H,), float32.
      topk_length: optional (T,), int32; clamped to [0, K].

    Returns:
      out (T, H, 512) bfloat16, max_logits (T, H) float32, lse (T, H) float32.

    Inputs are copied to contiguous if they are not (the kernel needs dense tensors).
    """
    fn = load_flash_mla()
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q: the flashmla backend takes bfloat16, got {q.dtype}")
    T, H, D = q.shape
    if D not in FLASHMLA_HEAD_DIMS:
        raise ValueError(f"q: the flashmla backend needs head dim D in {FLASHMLA_HEAD_DIMS}, got {D}")
    reason = unavailable_reason(q.device)
    if reason is not None:
        raise BackendUnavailableError(f"flashmla backend unavailable: {reason}")
    S, K = kv.shape[0], indices.shape[1]

    # Rewrite every invalid entry to -1 and pad the width to a multiple of 128 with -1.
    width = max(INDEX_ALIGN, -(-K // INDEX_ALIGN) * INDEX_ALIGN)
    cols = torch.arange(K, device=q.device)
    bad = (indices < 0) | (indices >= S)
    tlen = None
    if topk_length is not None:
        tlen = topk_length.clamp(0, K).to(torch.int32).contiguous()
        bad |= cols[None, :] >= tlen[:, None]
    idx = torch.full((T, 1, width), -1, dtype=torch.int32, device=q.device)
    idx[:, 0, :K] = indices.masked_fill(bad, -1)
    kv3 = kv.contiguous().view(S, 1, D)
    sink = attn_sink.to(torch.float32) if attn_sink is not None else None

    kwargs = {}
    if "use_legacy" in _parameters(fn):
        major, _ = torch.cuda.get_device_capability(q.device)
        kwargs["use_legacy"] = major == 9  # sgl-flash-mla keeps the Hopper kernels as legacy ones

    out = torch.empty((T, H, FLASHMLA_D_V), dtype=q.dtype, device=q.device)
    max_logits = torch.empty((T, H), dtype=torch.float32, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    for h0 in range(0, H, 128):  # FlashMLA takes at most 128 heads: split, heads are independent
        h1 = min(H, h0 + 128)
        n = h1 - h0
        padded = next(h for h in FLASHMLA_HEADS if n <= h)  # sparse_fwd.h dispatches h_q 64 and 128 (SM90, SM100)
        q_g = q[:, h0:h1]
        sink_g = sink[h0:h1] if sink is not None else None
        if padded != n:
            q_g = torch.cat([q_g, q_g.new_zeros((T, padded - n, D))], dim=1)
            if sink_g is not None:
                sink_g = torch.cat([sink_g, sink_g.new_full((padded - n,), -math.inf)])
        res = fn(
            q_g.contiguous(), kv3, idx, float(sm_scale), d_v=FLASHMLA_D_V, attn_sink=sink_g, topk_length=tlen, **kwargs
        )
        o_g, max_g, lse_g = res[0], res[1], res[2]  # newer wheels may append more outputs
        out[:, h0:h1] = o_g.reshape(T, padded, -1)[:, :n]
        max_logits[:, h0:h1] = max_g.reshape(T, padded)[:, :n]
        lse[:, h0:h1] = lse_g.reshape(T, padded)[:, :n]
    return out, max_logits, lse


@functools.lru_cache(maxsize=8)  # inspect.signature costs microseconds; this runs per call
def _parameters(fn) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a C++ builtin without a signature
        return ()
