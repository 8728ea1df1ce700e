"""dsv4_torch.sparse_attention against the float64 oracle (planner.oracle.sparse_attention): the
contract on every backend that runs here, NaN inputs, and bad inputs.

Tolerances: tests/torch/sparse_cases.py. The Triton backend runs under Triton's interpreter on CPU
(tests/conftest.py turns it on when there is no GPU), so its cases are tiny: H = 16, D <= 64 (one
case with D = 576), K <= 256. Backend choice and the GPU kernels' specifics:
test_torch_sparse_backends.py; the reference kernel's own properties (tile invariance, backward,
dropout): test_torch_sparse_reference.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dsv4_torch
from dsv4_torch import sparse_attention
from tests.torch.sparse_cases import (
    BACKENDS,
    DEVICE,
    assert_out_fp32_close,
    assert_stats_close,
    check,
    make_case,
    on,
    run_oracle,
)

# ----------------------------------------------------------------------------- against the oracle


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink", [None, "random"])
def test_random_inputs(backend, dtype, sink):
    kv_scale = 1.0 if dtype == torch.float32 else 0.1
    case = make_case(9, 16, 64, 90, 200, seed=1, dtype=dtype, topk=True, sink=sink, kv_scale=kv_scale)
    check(case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_d576_has_512_value_dims(backend, dtype):
    kv_scale = 1.0 if dtype == torch.float32 else 0.1
    case = make_case(3, 16, 576, 50, 96, seed=2, dtype=dtype, topk=True, sink="random", kv_scale=kv_scale)
    out, _, _ = check(case, backend)
    assert out.shape == (3, 16, 512)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16(backend):
    check(make_case(5, 16, 64, 40, 64, seed=3, dtype=torch.float16, sink="random", kv_scale=0.1), backend)


def test_float64_reference_is_exact_to_the_oracle():
    out, max_logits, lse = check(
        make_case(6, 5, 24, 30, 50, seed=4, dtype=torch.float64, topk=True, sink="random"), "reference"
    )
    assert out.dtype == max_logits.dtype == lse.dtype == torch.float64


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sink", [float("-inf"), 0.0, 30.0, float("inf")])
def test_sinks(backend, sink):
    case = make_case(6, 16, 64, 40, 128, seed=5, sink=sink)
    out, _, lse = check(case, backend)
    if sink == float("-inf"):  # -inf means no sink: identical to passing none
        plain, _, plain_lse = sparse_attention(
            **on(DEVICE if backend != "reference" else "cpu", {**case, "attn_sink": None}), backend=backend
        )
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
    if sink == 30.0:  # a large sink nearly silences the output but leaves lse alone
        assert out.abs().max() < 1e-6 * case["kv"].abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_entries_and_all_invalid_rows(backend):
    T, H, D, S, K = 6, 16, 64, 30, 200  # K: not a multiple of 128
    case = make_case(T, H, D, S, K, seed=6, invalid=0.3, sink="random")
    idx = case["indices"]
    idx[0] = -1  # all -1
    idx[1] = -5  # all < -1
    idx[2] = S  # all == S
    idx[3, :] = torch.arange(S, S + K, dtype=torch.int32)  # all >= S
    out, max_logits, lse = check(case, backend)
    assert torch.all(out[:4] == 0) and torch.all(torch.isposinf(lse[:4])) and torch.all(torch.isneginf(max_logits[:4]))
    assert torch.isfinite(lse[4:]).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_length_cuts_valid_prefix(backend):
    T, H, D, S, K = 6, 16, 64, 60, 256
    case = make_case(T, H, D, S, K, seed=7, invalid=0.0, sink="random")
    # Valid entries run well past topk_length; those must be ignored. 0 -> nothing valid.
    case["topk_length"] = torch.tensor([0, 1, 37, 128, 255, 300], dtype=torch.int32)
    out, max_logits, lse = check(case, backend)
    assert torch.all(out[0] == 0) and torch.isposinf(lse[0]).all() and torch.isneginf(max_logits[0]).all()
    # Cutting at topk_length equals dropping the columns.
    cut = {**case, "topk_length": None, "indices": case["indices"].clone()}
    cut["indices"][2, 37:] = -1
    want = sparse_attention(**on(DEVICE if backend != "reference" else "cpu", cut), backend=backend)[0]
    torch.testing.assert_close(out[2], want[2], rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicated_indices_count_each_time(backend):
    T, H, D, S, K = 4, 16, 64, 10, 64
    case = make_case(T, H, D, S, K, seed=8, invalid=0.0)
    case["indices"][:, :] = 3
    case["indices"][:, 16:] = 7  # 16 copies of row 3, 48 of row 7
    out, _, lse = check(case, backend)
    # lse over 16 + 48 equal logits: ln(16 e^a + 48 e^b)
    q, kv = case["q"].double(), case["kv"].double()
    a = (q @ kv[3]) * case["sm_scale"]
    b = (q @ kv[7]) * case["sm_scale"]
    expect = torch.logaddexp(a + np.log(16), b + np.log(48))
    torch.testing.assert_close(lse.cpu().double(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("K", [1, 37, 128, 129, 256])
def test_index_widths(backend, K):
    check(make_case(4, 16, 64, 50, K, seed=9 + K, topk=True, sink="random"), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_dim_kv_and_indices(backend):
    case = make_case(5, 16, 64, 40, 64, seed=10, topk=True, sink="random")
    dev = DEVICE if backend != "reference" else "cpu"
    flat = sparse_attention(**on(dev, case), backend=backend)
    shaped = {**case, "kv": case["kv"][:, None, :], "indices": case["indices"][:, None, :]}
    for a, b in zip(flat, sparse_attention(**on(dev, shaped), backend=backend)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    case = make_case(5, 16, 64, 40, 64, seed=11, topk=True, sink="random")
    dev = DEVICE if backend != "reference" else "cpu"
    want = sparse_attention(**on(dev, case), backend=backend)
    strided = {
        **case,
        "q": case["q"].transpose(0, 1).contiguous().transpose(0, 1),  # (T, H, D) with H-major storage
        "kv": torch.cat([case["kv"], case["kv"]], dim=1)[:, :64],  # row stride 128
        "indices": case["indices"].t().contiguous().t(),
    }
    assert not strided["q"].is_contiguous() and not strided["kv"].is_contiguous()
    for a, b in zip(want, sparse_attention(**on(dev, strided), backend=backend)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens(backend):
    case = make_case(0, 16, 64, 10, 64)
    out, max_logits, lse = sparse_attention(**case, backend=backend)
    assert out.shape == (0, 16, 64) and max_logits.shape == lse.shape == (0, 16)


# ----------------------------------------------------------------------------- NaN inputs


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inputs_propagate_like_the_oracle(backend):
    """A NaN in q (one head) or in a gathered kv row (every head) makes that token's out, lse and
    max_logits NaN, as in planner.oracle; a token with no valid key stays out 0 / lse +inf, and
    other tokens are untouched."""
    T, H, D, S, K = 6, 16, 64, 40, 96
    case = make_case(T, H, D, S, K, seed=21, invalid=0.2, sink="random")
    idx, q, kv = case["indices"], case["q"], case["kv"]
    idx[idx == S - 1] = 0  # row S-1 is read by token 2 only
    idx[2, 70] = S - 1  # in the second key block
    kv[S - 1, 5] = float("nan")
    q[1, 3, 7] = float("nan")  # token 1, head 3
    q[4, :, 0] = float("nan")  # token 4 has NaN queries but no valid key
    idx[4] = -1
    dev = DEVICE if backend != "reference" else "cpu"
    got = [x.detach().cpu().double().numpy() for x in sparse_attention(**on(dev, case), backend=backend)]
    want = run_oracle(case)
    for name, g, w in zip(("out", "max_logits", "lse"), got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{name}: NaN pattern")
    assert np.isnan(want[0][1, 3]).all() and np.isnan(want[0][2]).all()
    assert not np.isnan(want[0][[0, 3, 4, 5]]).any()
    assert (got[0][4] == 0).all() and np.isposinf(got[2][4]).all() and np.isneginf(got[1][4]).all()
    keep = [0, 3, 5]  # tokens without NaN: as close as ever
    assert_out_fp32_close(torch.from_numpy(got[0][keep]), want[0][keep])
    assert_stats_close(torch.from_numpy(got[2][keep]), want[2][keep], 1e-5, "lse")


# ----------------------------------------------------------------------------- bad inputs


def _good():
    return make_case(3, 4, 16, 10, 8, topk=True, sink="random")


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda c: c.update(q=c["q"][0]), ValueError, "q: expected shape"),
        (lambda c: c.update(q=c["q"].numpy()), TypeError, "q: expected a torch.Tensor"),
        (lambda c: c.update(q=c["q"].int(), kv=c["kv"].int()), TypeError, "q: expected bfloat16"),
        (lambda c: c.update(kv=c["kv"][:, :8]), ValueError, "kv: last dim 8"),
        (lambda c: c.update(kv=c["kv"].double()), TypeError, "kv: dtype"),
        (lambda c: c.update(kv=c["kv"][:, None].expand(10, 2, 16)), ValueError, r"kv: expected shape \(S, 1, D\)"),
        (lambda c: c.update(kv=c["kv"][None]), ValueError, "kv: expected shape"),
        (lambda c: c.update(indices=c["indices"].long()), TypeError, "indices: expected int32"),
        (lambda c: c.update(indices=c["indices"][:2]), ValueError, "indices: 2 rows for 3"),
        (lambda c: c.update(indices=c["indices"][0]), ValueError, "indices: expected shape"),
        (
            lambda c: c.update(indices=c["indices"][:, None].expand(3, 2, 8)),
            ValueError,
            r"indices: expected shape \(T, 1, K\)",
        ),
        (lambda c: c.update(topk_length=c["topk_length"][:2]), ValueError, r"topk_length: expected shape \(3,\)"),
        (lambda c: c.update(topk_length=c["topk_length"].long()), TypeError, "topk_length: expected int32"),
        (lambda c: c.update(attn_sink=c["attn_sink"][:3]), ValueError, r"attn_sink: expected shape \(4,\)"),
        (lambda c: c.update(attn_sink=c["attn_sink"].bfloat16()), TypeError, "attn_sink: expected float32"),
        (lambda c: c.update(sm_scale=float("nan")), ValueError, "sm_scale: must be finite"),
        (lambda c: c.update(sm_scale="0.1"), TypeError, "sm_scale: expected a real number"),
        (lambda c: c.update(sm_scale=torch.tensor(0.1, device="meta")), TypeError, "sm_scale: pass a float"),
        (lambda c: c.update(sm_scale=torch.tensor([0.1])), TypeError, "sm_scale: pass a float"),
        (lambda c: c.update(attn_sink=c["attn_sink"].to("meta")), ValueError, "attn_sink: on device meta"),
        (lambda c: c.update(indices=c["indices"].to("meta")), ValueError, "indices: on device meta"),
    ],
)
def test_bad_inputs_name_the_argument(change, exc, match):
    c = _good()
    change(c)
    with pytest.raises(exc, match=match):
        sparse_attention(**c, backend="reference")


def test_sm_scale_as_a_cpu_scalar_tensor():
    c = _good()
    want = sparse_attention(**c, backend="reference")
    got = sparse_attention(**{**c, "sm_scale": torch.tensor(c["sm_scale"], dtype=torch.float64)}, backend="reference")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_bad_backend_name():
    with pytest.raises(ValueError, match="backend: expected one of"):
        sparse_attention(**_good(), backend="fast")


def test_package_exports():
    assert dsv4_torch.sparse_attention is sparse_attention
    assert set(dsv4_torch.BACKENDS) == {"flashmla", "triton", "cpu", "reference"}
