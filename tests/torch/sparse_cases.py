"""Inputs and checks shared by the torch sparse-attention tests (test_torch_sparse_*.py).

Tolerances against the float64 oracle (planner.oracle.sparse_attention):
- float32 inputs: out within 1e-5 of the oracle relative to the largest |out| of the call
  (max abs error / max abs value); lse and max_logits elementwise within 1e-5 * max(1, |ref|);
  the +inf / -inf pattern of lse / max_logits must match exactly.
- bf16 / fp16 inputs: FlashMLA's own check for out (every element within abs 8e-4 or rel 3.01/128
  of the float reference built from the same rounded inputs, cosine diff < 7e-6), on data at
  FlashMLA's test scale (kv ~ N(0, 0.1^2)); lse and max_logits as for float32, but 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4_torch import available_backends, sparse_attention
from planner import oracle

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
AVAILABLE = available_backends()
needs_triton = pytest.mark.skipif(AVAILABLE["triton"] is not None, reason=f"triton: {AVAILABLE['triton']}")
needs_flashmla = pytest.mark.skipif(AVAILABLE["flashmla"] is not None, reason="needs an SM90/SM100 GPU")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]


def make_case(T, H, D, S, K, *, seed=0, dtype=torch.float32, invalid=0.2, topk=False, sink=None, kv_scale=1.0):
    """Random inputs. invalid: fraction of entries that are -1, < -1 or >= S."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(S, D, generator=g) * kv_scale
    # Logits with std ~1.5 whatever the kv scale, so the softmax is neither flat nor one-hot.
    q = torch.randn(T, H, D, generator=g) * (1.5 / kv_scale)
    idx = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    r = torch.rand(T, K, generator=g)
    idx[r < invalid] = -1
    idx[r < invalid / 3] = -7
    idx[(r >= invalid / 3) & (r < invalid / 2)] = S + 3
    tlen = torch.randint(0, K + 4, (T,), generator=g, dtype=torch.int32) if topk else None
    sink_t = None
    if sink == "random":
        sink_t = torch.randn(H, generator=g)
    elif sink is not None:
        sink_t = torch.full((H,), float(sink))
    return dict(q=q.to(dtype), kv=kv.to(dtype), indices=idx, sm_scale=D**-0.5, attn_sink=sink_t, topk_length=tlen)


def on(device, case):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def run_oracle(case):
    f64 = lambda t: None if t is None else t.detach().cpu().double().numpy()  # noqa: E731
    return oracle.sparse_attention(
        f64(case["q"]),
        f64(case["kv"]),
        case["indices"].cpu().numpy(),
        case["sm_scale"],
        f64(case["attn_sink"]),
        None if case["topk_length"] is None else case["topk_length"].cpu().numpy(),
    )


def assert_stats_close(got, want, tol, name):
    got = got.detach().cpu().double().numpy()
    assert got.shape == want.shape, name
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"{name}: +inf pattern")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{name}: -inf pattern")
    fin = np.isfinite(want)
    err = np.abs(got[fin] - want[fin]) / np.maximum(1.0, np.abs(want[fin]))
    assert err.size == 0 or err.max() <= tol, f"{name}: max rel error {err.max():.3g} > {tol}"


def assert_out_fp32_close(got, want, tol=1e-5):
    got = got.detach().cpu().double().numpy()
    assert got.shape == want.shape
    scale = max(np.abs(want).max(initial=0.0), 1e-30)
    err = np.abs(got - want).max(initial=0.0) / scale
    assert err <= tol, f"out: max abs error / max abs value = {err:.3g} > {tol}"


def assert_out_flashmla_close(got, want):
    """FlashMLA's test check for out: abs 8e-4 or rel 3.01/128 per element, cosine diff < 7e-6."""
    got = got.detach().cpu().double().numpy()
    assert got.shape == want.shape
    abs_err = np.abs(got - want)
    rel_err = abs_err / (np.abs(want) + 1e-6)
    bad = ~((abs_err < 8e-4) | (rel_err < 3.01 / 128))
    assert not bad.any(), (
        f"out: {bad.sum()} of {bad.size} elements outside abs 8e-4 / rel 3.01/128, max abs {abs_err.max():.3g}"
    )
    denom = (got * got + want * want).sum()
    cos_diff = 0.0 if denom < 1e-12 else 1 - 2 * (got * want).sum() / denom
    assert cos_diff < 7e-6, f"out: cosine diff {cos_diff:.3g}"


def check(case, backend, device=DEVICE):
    if backend == "reference":
        device = "cpu"
    out, max_logits, lse = sparse_attention(**on(device, case), backend=backend)
    want_out, want_max, want_lse = run_oracle(case)
    q = case["q"]
    assert out.dtype == q.dtype and out.device.type == torch.device(device).type
    stat_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    assert max_logits.dtype == stat_dtype and lse.dtype == stat_dtype
    if q.dtype in (torch.float32, torch.float64):
        assert_out_fp32_close(out, want_out, 1e-12 if q.dtype == torch.float64 else 1e-5)
        tol = 1e-12 if q.dtype == torch.float64 else 1e-5
    else:
        assert_out_flashmla_close(out, want_out)
        tol = 1e-4
    assert_stats_close(max_logits, want_max, tol, "max_logits")
    assert_stats_close(lse, want_lse, tol, "lse")
    return out, max_logits, lse
