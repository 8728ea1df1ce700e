"""dsv4_torch.sparse_attention against the float64 oracle (planner.oracle.sparse_attention).

Tolerances:
- float32 inputs: out within 1e-5 of the oracle relative to the largest |out| of the call
  (max abs error / max abs value); lse and max_logits elementwise within 1e-5 * max(1, |ref|);
  the +inf / -inf pattern of lse / max_logits must match exactly.
- bf16 / fp16 inputs: FlashMLA's own check for out (every element within abs 8e-4 or rel 3.01/128
  of the float reference built from the same rounded inputs, cosine diff < 7e-6), on data at
  FlashMLA's test scale (kv ~ N(0, 0.1^2)); lse and max_logits as for float32, but 1e-4.
- Tile invariance of the reference backend is bitwise.

The Triton backend runs under Triton's interpreter on CPU (tests/conftest.py turns it on when
there is no GPU), so its cases are tiny: H = 16, D <= 64 (one case with D = 576), K <= 256.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import dsv4_torch
from dsv4_torch import BackendUnavailableError, available_backends, resolve_backend, sparse_attention
from dsv4_torch.kernels import reference as ref_kernel
from planner import oracle

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
AVAILABLE = available_backends()
needs_triton = pytest.mark.skipif(AVAILABLE["triton"] is not None, reason=f"triton: {AVAILABLE['triton']}")
needs_flashmla = pytest.mark.skipif(AVAILABLE["flashmla"] is not None, reason="needs an SM90/SM100 GPU")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]


# ----------------------------------------------------------------------------- helpers


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
        f64(case["q"]), f64(case["kv"]), case["indices"].cpu().numpy(), case["sm_scale"],
        f64(case["attn_sink"]), None if case["topk_length"] is None else case["topk_length"].cpu().numpy(),
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
    assert not bad.any(), f"out: {bad.sum()} of {bad.size} elements outside abs 8e-4 / rel 3.01/128, max abs {abs_err.max():.3g}"
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
    out, max_logits, lse = check(make_case(6, 5, 24, 30, 50, seed=4, dtype=torch.float64, topk=True, sink="random"), "reference")
    assert out.dtype == max_logits.dtype == lse.dtype == torch.float64


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sink", [float("-inf"), 0.0, 30.0, float("inf")])
def test_sinks(backend, sink):
    case = make_case(6, 16, 64, 40, 128, seed=5, sink=sink)
    out, _, lse = check(case, backend)
    if sink == float("-inf"):  # -inf means no sink: identical to passing none
        plain, _, plain_lse = sparse_attention(**on(DEVICE if backend != "reference" else "cpu", {**case, "attn_sink": None}), backend=backend)
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


@needs_triton
@pytest.mark.parametrize("cfg", [(16, 16, 4, 1), (32, 64, 4, 2), (64, 32, 8, 2)])
def test_triton_launch_configs_agree(cfg):
    # H = 40: several head blocks, the last one partly masked; D = 48: masked value dims.
    from dsv4_torch.kernels import triton_sparse as ts

    case = make_case(5, 40, 48, 60, 150, seed=17, topk=True, sink="random")
    got = ts.sparse_attention_triton(**on(DEVICE, case), config=ts.TritonConfig(*cfg))
    want_out, want_max, want_lse = run_oracle(case)
    assert_out_fp32_close(got[0], want_out)
    assert_stats_close(got[1], want_max, 1e-5, "max_logits")
    assert_stats_close(got[2], want_lse, 1e-5, "lse")


@needs_triton
def test_triton_two_head_blocks_per_token():
    # H = 128 with block_h = 64: two programs per token, pid -> (token, head block) on a 1-D grid.
    from dsv4_torch.kernels import triton_sparse as ts

    case = make_case(3, 128, 32, 40, 64, seed=19, topk=True, sink="random")
    got = ts.sparse_attention_triton(**on(DEVICE, case), config=ts.TritonConfig(64, 32, 4, 1))
    want_out, want_max, want_lse = run_oracle(case)
    assert_out_fp32_close(got[0], want_out)
    assert_stats_close(got[1], want_max, 1e-5, "max_logits")
    assert_stats_close(got[2], want_lse, 1e-5, "lse")


@needs_triton
def test_triton_grid_fits_cuda_limits(monkeypatch):
    """CUDA caps grid axes y and z at 65,535 (the interpreter does not): T > 65,535 tokens must
    launch on axis x. The launch is recorded, not run."""
    from dsv4_torch.kernels import triton_sparse as ts

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(ts, "_sparse_attention_kernel", Recorder())
    T, H = 70_000, 40
    q = torch.zeros(T, H, 16)
    ts.sparse_attention_triton(q, torch.zeros(4, 16), torch.zeros(T, 16, dtype=torch.int32), 1.0,
                               config=ts.TritonConfig(16, 16, 4, 1))
    (grid,) = grids
    assert all(n <= 65_535 for n in grid[1:]) and grid[0] < 2**31, grid
    assert int(np.prod(grid)) == T * 3  # 3 head blocks of 16 for H = 40


@pytest.mark.skipif(not GPU, reason="needs an SM90/SM100 GPU")
@pytest.mark.gpu
def test_triton_more_tokens_than_grid_axis_y_on_gpu():
    T = 70_000  # > 65,535, the CUDA limit of grid axes y and z
    case = make_case(T, 16, 32, 256, 32, seed=20, topk=True, sink="random")
    got = sparse_attention(**on("cuda", case), backend="triton")
    want = sparse_attention(**on("cuda", case), backend="reference")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got[2][-1]).any()  # the last tokens were computed, not left as garbage


@pytest.mark.parametrize(
    "fields, match",
    [
        ((24, 32, 4, 2), "block_h: must be a power of two, got 24"),
        ((32, 48, 4, 2), "block_k: must be a power of two, got 48"),
        ((8, 32, 4, 2), "block_h: expected an int >= 16, got 8"),
        ((32, 32, 3, 2), "num_warps: must be a power of two, got 3"),
        ((32, 32, 4, 0), "num_stages: expected an int >= 1, got 0"),
    ],
)
def test_triton_config_rejects_bad_fields(fields, match):
    from dsv4_torch.kernels import triton_sparse as ts

    with pytest.raises(ValueError, match=match):
        ts.TritonConfig(*fields)


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


# ----------------------------------------------------------------------------- host syncs


def test_reference_backend_never_syncs_with_the_host(monkeypatch):
    """`auto` reaches the reference backend on GPUs too (float64, no Triton): it must queue work
    without reading device values on the host (nonzero, int(), bool())."""
    from tests.no_host_sync import forbid_host_sync

    case = make_case(150, 16, 64, 90, 200, seed=22, topk=True, sink="random")  # several token tiles
    case["indices"][:, 130:] = -1  # trailing all-invalid key blocks
    want = sparse_attention(**case, backend="reference")  # CPU: skips the empty blocks
    monkeypatch.setattr(ref_kernel, "SKIP_EMPTY_BLOCKS_ON_CPU", False)  # what runs on a GPU
    with forbid_host_sync():
        got = sparse_attention(**case, backend="reference")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_reference_odd_sizes():
    # H, D not multiples of anything; a head dim above 512 that is not 576.
    check(make_case(5, 3, 33, 20, 70, seed=12, topk=True, sink="random"), "reference")
    out, _, _ = check(make_case(2, 2, 600, 20, 70, seed=13, sink="random"), "reference")
    assert out.shape == (2, 2, 512)


# ----------------------------------------------------------------------------- tile invariance


@pytest.mark.parametrize("H, D", [(16, 64), (3, 33)])
def test_reference_is_bitwise_tile_invariant(H, D):
    T, S, K = 300, 200, 128
    tile = ref_kernel.token_tile(H, D, torch.float32)
    assert tile < T, "the call must span more than one token tile"
    case = make_case(T, H, D, S, K, seed=14, topk=True, sink="random")
    full = sparse_attention(**case, backend="reference")

    def sub(lo, hi, extra_cols=0):
        c = {**case, "q": case["q"][lo:hi], "indices": case["indices"][lo:hi], "topk_length": case["topk_length"][lo:hi]}
        if extra_cols:  # pad the row width with invalid entries, as a wider chunk would
            pad = torch.full((hi - lo, extra_cols), -1, dtype=torch.int32)
            c["indices"] = torch.cat([c["indices"], pad], dim=1)
        return sparse_attention(**c, backend="reference")

    for lo, hi, extra in [(7, 8, 0), (3, 40, 0), (250, 300, 0), (5, 290, 0), (100, 101, 192), (11, 59, 64)]:
        part = sub(lo, hi, extra)
        for a, b in zip(part, full):
            assert torch.equal(a, b[lo:hi]), f"tokens {lo}:{hi} (+{extra} invalid columns) differ from the full call"


def test_reference_token_tile_depends_only_on_heads_dim_dtype():
    assert ref_kernel.token_tile(64, 512, torch.bfloat16) == ref_kernel.token_tile(64, 512, torch.float32)
    assert ref_kernel.token_tile(64, 512, torch.float32) >= 16


# ----------------------------------------------------------------------------- FlashMLA (GPU only)


@needs_flashmla
@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64, 128, 192])
@pytest.mark.parametrize("D", [512, 576])
def test_flashmla_matches_oracle(H, D):
    case = make_case(64, H, D, 4096, 200, seed=15, dtype=torch.bfloat16, topk=True, sink="random", kv_scale=0.1)
    case["indices"][0] = -1
    check(case, "flashmla", "cuda")


@needs_flashmla
@pytest.mark.gpu
@pytest.mark.parametrize("sink", [float("-inf"), 0.0, 30.0])
def test_flashmla_sinks_and_edge_rows(sink):
    case = make_case(8, 64, 512, 100, 128, seed=16, dtype=torch.bfloat16, invalid=0.0, sink=sink, kv_scale=0.1)
    case["topk_length"] = torch.tensor([0, 1, 5, 64, 127, 128, 200, 3], dtype=torch.int32)
    case["indices"][7] = torch.arange(100, 228, dtype=torch.int32)  # all >= S
    case["indices"][6, :8] = 3  # duplicates
    check(case, "flashmla", "cuda")


def test_flashmla_wrapper_pads_and_strips(monkeypatch):
    """The wrapper's padding, index clean-up and head split, run on CPU against a stand-in kernel
    that enforces FlashMLA's input constraints and computes with the reference."""
    from dsv4_torch.kernels import flashmla

    calls = []

    def fake_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False):
        T, H, D = q.shape
        S = kv.shape[0]
        assert q.dtype == kv.dtype == torch.bfloat16 and q.is_contiguous() and kv.is_contiguous()
        assert H in (64, 128) and D in (512, 576) and d_v == 512 and kv.shape[1:] == (1, D)
        assert indices.dtype == torch.int32 and indices.shape[:2] == (T, 1) and indices.shape[2] % 128 == 0
        assert bool(((indices == -1) | ((indices >= 0) & (indices < S))).all()), "only -1 may be invalid"
        assert attn_sink is None or (attn_sink.dtype == torch.float32 and attn_sink.shape == (H,))
        assert topk_length is None or bool(((topk_length >= 0) & (topk_length <= indices.shape[2])).all())
        calls.append((H, indices.shape[2], use_legacy))
        return ref_kernel.sparse_attention_reference(q, kv[:, 0], indices[:, 0], sm_scale, attn_sink, topk_length)

    monkeypatch.setitem(flashmla._cache, "fn", fake_sparse_fwd)
    monkeypatch.setattr(flashmla, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for H, K in ((16, 200), (64, 128), (192, 130)):
        case = make_case(4, H, 512, 300, K, seed=18, dtype=torch.bfloat16, topk=True, sink="random", kv_scale=0.1)
        case["indices"][0, :5] = torch.tensor([-9, 300, 301, -1, 5], dtype=torch.int32)
        calls.clear()
        got = flashmla.sparse_attention_flashmla(**case)
        want = ref_kernel.sparse_attention_reference(**case)
        for a, b in zip(got, want):  # heads padded with zeros: same values up to rounding
            torch.testing.assert_close(a, b)
        expect_heads = [64] if H <= 64 else [128, 64]
        assert [c[0] for c in calls] == expect_heads
        assert all(c[1] == -(-K // 128) * 128 and c[2] is True for c in calls)  # SM90: use_legacy=True


def test_flashmla_wrapper_inspects_the_signature_once(monkeypatch):
    """Upstream FlashMLA's flash_mla_sparse_fwd has no use_legacy: it is not passed, and the
    signature is looked up once per function, not per call."""
    import inspect

    from dsv4_torch.kernels import flashmla

    def upstream_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        return ref_kernel.sparse_attention_reference(q, kv[:, 0], indices[:, 0], sm_scale, attn_sink, topk_length)

    lookups = []
    real_signature = inspect.signature

    def counting_signature(fn, *args, **kwargs):
        lookups.append(fn)
        return real_signature(fn, *args, **kwargs)

    flashmla._parameters.cache_clear()
    monkeypatch.setattr(flashmla.inspect, "signature", counting_signature)
    monkeypatch.setitem(flashmla._cache, "fn", upstream_sparse_fwd)
    monkeypatch.setattr(flashmla, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    case = make_case(2, 64, 512, 50, 128, seed=23, dtype=torch.bfloat16, sink="random", kv_scale=0.1)
    for _ in range(3):
        flashmla.sparse_attention_flashmla(**case)  # TypeError if use_legacy were passed
    assert lookups.count(upstream_sparse_fwd) == 1


@pytest.mark.skipif(not GPU, reason="needs an SM90/SM100 GPU")
def test_auto_prefers_flashmla_on_sm90_sm100():
    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16, device="cuda")
    want = "flashmla" if AVAILABLE["flashmla"] is None else "triton"
    assert resolve_backend("auto", q) == want


# ----------------------------------------------------------------------------- backend selection


def test_resolve_backend_on_cpu():
    q = torch.zeros(1, 16, 64)
    # fp32 on CPU: the C kernel where it builds (tests/test_torch_cpu_attention.py), else reference
    assert resolve_backend("auto", q) == ("cpu" if AVAILABLE["cpu"] is None else "reference")
    assert resolve_backend("auto", q.double()) == "reference"
    assert resolve_backend("reference", q) == "reference"
    if not GPU:
        with pytest.raises(BackendUnavailableError, match="SM90/SM100"):
            resolve_backend("flashmla", q)
        with pytest.raises(BackendUnavailableError, match="bfloat16|float64"):
            resolve_backend("triton", q.double())
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", q)


def test_available_backends_reports_reasons():
    av = available_backends()
    assert set(av) == {"flashmla", "triton", "cpu", "reference"}
    assert av["reference"] is None
    for name, reason in av.items():
        assert reason is None or (isinstance(reason, str) and reason), name
    if not GPU:
        assert av["flashmla"] is not None


def test_backend_choice_is_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="dsv4_torch"):
        sparse_attention(**make_case(2, 16, 64, 10, 16, dtype=torch.float64), backend="auto")
    assert any("backend=reference (asked 'auto')" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(GPU, reason="CPU-only check")
def test_triton_on_cpu_without_interpreter_raises():
    code = (
        "import torch, dsv4_torch\n"
        "q = torch.zeros(1, 16, 64); kv = torch.zeros(4, 64); idx = torch.zeros(1, 16, dtype=torch.int32)\n"
        "try:\n"
        "    dsv4_torch.sparse_attention(q, kv, idx, 1.0, backend='triton')\n"
        "except dsv4_torch.BackendUnavailableError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "RAISED" in res.stdout and "TRITON_INTERPRET=1" in res.stdout, res.stdout + res.stderr


def _ptxas_available():
    try:
        from tools.triton_compile import triton_bin_dir

        return os.path.exists(os.path.join(triton_bin_dir(), "ptxas"))
    except ImportError:
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="needs Triton's bundled ptxas (NVIDIA build of triton)")
@pytest.mark.parametrize("arch", [90, 80])
def test_triton_kernel_compiles_for_gpus(arch):
    """Ahead-of-time compile (no GPU needed) catches what the interpreter cannot: layouts, types,
    register and shared-memory limits of the default launch config on H100 / A100."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-m", "bench.triton_resources_torch", "--arch", str(arch), "--dim", "512"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    row = res.stdout.strip().splitlines()[-1].split()
    assert len(row) >= 12 and row[7] == "yes", res.stdout  # compiled, fits shared memory
    regs, spill, wgmma, loop_spill = int(row[4]), int(row[5]), int(row[8]), int(row[11])
    assert 0 < regs <= 255
    assert spill == 0 and loop_spill == 0, res.stdout  # the default config does not spill at D=512
    assert (wgmma > 0) == (arch == 90), "BLOCK_H=64 on sm_90 should give wgmma"


def test_default_config_follows_the_triton_version_on_hopper():
    """Triton 3.6 (torch 2.11) spills 64,16,8,2 inside the key loop on sm_90 and not 64,16,8,1;
    Triton 3.9 the other way round (offline compiles, see default_config's docstring)."""
    from dsv4_torch.kernels import triton_sparse as ts

    old = ts.default_config(64, 512, torch.bfloat16, 90, triton_version=(3, 6))
    new = ts.default_config(64, 512, torch.bfloat16, 90, triton_version=(3, 9))
    assert (old.block_h, old.block_k, old.num_stages) == (64, 16, 1)
    assert (new.block_h, new.block_k, new.num_stages) == (64, 16, 2)
    assert ts.default_config(64, 512, torch.bfloat16, 100, triton_version=(3, 6)).num_stages == 2


def test_old_triton_interpreter_is_reported_not_run(monkeypatch):
    """Interpreters before Triton 3.9 cannot run the kernel: the backend says why instead."""
    from dsv4_torch.kernels import triton_sparse as ts

    if not ts.INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 (set by the test suite's conftest)")
    monkeypatch.setattr(ts, "INTERPRETER_UNSUPPORTED", "Triton 3.6.0's interpreter cannot run this kernel")
    case = make_case(3, 4, 16, 10, 8, topk=True, sink="random")
    assert "3.6.0" in available_backends()["triton"]
    with pytest.raises(BackendUnavailableError, match="3.6.0"):
        sparse_attention(**case, backend="triton")
    with pytest.raises(RuntimeError, match="3.6.0"):
        ts.sparse_attention_triton(case["q"], case["kv"], case["indices"], case["sm_scale"])


# ----------------------------------------------------------------------------- backward (reference)


def dense_attention(q, kv, indices, sm_scale, attn_sink=None, topk_length=None, keep=None, p=0.0):
    """Plain autograd torch: gathered keys, masked logits, softmax with the sink column, optional
    dropout mask keep (T, H, K) on the probabilities (transformers' eager formula)."""
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    d_v = 512 if D >= 512 else D
    valid = (indices >= 0) & (indices < S)
    if topk_length is not None:
        valid &= torch.arange(K)[None, :] < topk_length[:, None]
    keys = kv[torch.where(valid, indices, 0).long()]  # (T, K, D)
    s = torch.einsum("thd,tkd->thk", q, keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    sink = torch.full((H,), float("-inf"), dtype=s.dtype) if attn_sink is None else attn_sink.to(s.dtype)
    probs = torch.softmax(torch.cat([s, sink.view(1, H, 1).expand(T, H, 1)], -1), dim=-1)[..., :K]
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no key and no sink
    if keep is not None:
        probs = probs * keep / (1 - p)
    return torch.einsum("thk,tkd->thd", probs, keys[..., :d_v]), lse


def _grads(fn, case, seed=0):
    """Gradients of a random linear function of (out, finite lse) w.r.t. q, kv, attn_sink."""
    leaves = {k: case[k].detach().clone().requires_grad_(True) for k in ("q", "kv", "attn_sink") if case[k] is not None}
    args = {**case, **leaves}
    out, lse = fn(args)
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)  # the same weights at any dtype
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    loss = (out * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * w_lse).sum()
    loss.backward()
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _ours(args, **kw):
    out, _, lse = sparse_attention(**args, backend="reference", **kw)
    return out, lse


def _dense(args):
    return dense_attention(args["q"], args["kv"], args["indices"], args["sm_scale"], args["attn_sink"], args["topk_length"])


@pytest.mark.parametrize(
    "T, H, D, S, K, sink, topk",
    [(70, 3, 33, 40, 150, "random", True), (5, 16, 64, 30, 64, None, False), (130, 4, 576, 50, 80, "random", True),
     (9, 2, 16, 12, 40, 2.0, True)],  # fmt: skip
)
def test_reference_backward_matches_dense_autograd_in_float64(T, H, D, S, K, sink, topk):
    """Several token tiles and key blocks, invalid entries of every kind, rows with no valid key
    (row 3), duplicated indices, topk_length, sinks, D = 576 (value = first 512 dims), and lse's
    own gradient: q, kv and the sink's gradients equal plain autograd's to float64 rounding."""
    case = make_case(T, H, D, S, K, seed=40 + T, dtype=torch.float64, topk=topk, sink=sink)
    if case["attn_sink"] is not None:
        case["attn_sink"] = case["attn_sink"].double()
    case["indices"][3] = -1
    case["indices"][1, 1::2] = case["indices"][1, 0]  # duplicates count once per occurrence
    out, ours = _grads(_ours, case)
    want_out, want = _grads(_dense, case)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    assert set(ours) == set(want)
    for k in want:
        err = ((ours[k] - want[k]).abs().max() / want[k].abs().max()).item()
        assert err < 1e-12, f"d{k}: max rel error {err:.3g}"


def test_reference_backward_float32_and_bfloat16():
    case = make_case(70, 16, 64, 60, 130, seed=50, topk=True, sink="random")
    want_out, want = _grads(_dense, {**case, **{k: case[k].double() for k in ("q", "kv", "attn_sink")}})
    _, ours = _grads(_ours, case)
    for k in want:
        assert ((ours[k].double() - want[k]).abs().max() / want[k].abs().max()).item() < 1e-5, k
    bf = {**case, "q": case["q"].bfloat16(), "kv": case["kv"].bfloat16()}
    _, ours_bf = _grads(_ours, bf)
    assert ours_bf["q"].dtype == ours_bf["kv"].dtype == torch.bfloat16 and ours_bf["attn_sink"].dtype == torch.float32
    for k in want:  # bf16 inputs, float32 accumulation: within bf16's rounding of the inputs
        assert ((ours_bf[k].double() - want[k]).abs().max() / want[k].abs().max()).item() < 5e-2, k


def test_forward_under_autograd_is_bitwise_the_no_grad_kernel():
    case = make_case(150, 16, 64, 90, 200, seed=51, topk=True, sink="random")
    with torch.no_grad():
        want = sparse_attention(**case, backend="reference")
    q = case["q"].clone().requires_grad_(True)
    got = sparse_attention(**{**case, "q": q}, backend="reference")
    assert got[0].requires_grad and not got[1].requires_grad and got[2].requires_grad
    for a, b in zip(got, want):
        assert torch.equal(a.detach(), b)


def test_backward_of_zero_tokens_and_untouched_rows():
    case = make_case(0, 4, 16, 10, 8)
    q, kv = case["q"].requires_grad_(True), case["kv"].requires_grad_(True)
    out, _, _ = sparse_attention(**{**case, "q": q, "kv": kv}, backend="reference")
    out.sum().backward()
    assert q.grad.shape == q.shape and torch.equal(kv.grad, torch.zeros_like(kv))
    case = make_case(4, 4, 16, 10, 8, seed=52, invalid=0.0)
    case["indices"][:] = 2  # only row 2 is read
    kv = case["kv"].requires_grad_(True)
    sparse_attention(**{**case, "kv": kv}, backend="reference")[0].sum().backward()
    assert kv.grad[2].abs().sum() > 0 and torch.equal(kv.grad[torch.arange(10) != 2], torch.zeros(9, 16))


def test_backends_without_a_backward_refuse_when_a_gradient_is_required():
    q = torch.zeros(2, 16, 64, requires_grad=True)
    for name in ("triton", "flashmla"):
        with pytest.raises(BackendUnavailableError, match=rf"backend='{name}' has no backward.*backend='reference'"):
            resolve_backend(name, q, needs_grad=True)
        with pytest.raises(BackendUnavailableError, match=rf"backend='{name}' has no attention dropout"):
            resolve_backend(name, q, dropout_p=0.1)
    assert resolve_backend("auto", q, needs_grad=True) == "reference"
    case = make_case(3, 16, 64, 10, 8)
    with pytest.raises(BackendUnavailableError, match="has no backward"):
        sparse_attention(**{**case, "q": case["q"].requires_grad_(True)}, backend="triton")
    with torch.no_grad():  # no gradient needed: the usual availability check (here: CPU)
        with pytest.raises(BackendUnavailableError, match="cannot run here"):
            sparse_attention(**case, backend="flashmla")


def test_reference_backward_never_syncs_with_the_host(monkeypatch):
    """The backward on the device path (every key block, as on a GPU) reads nothing on the host."""
    from tests.no_host_sync import forbid_host_sync

    case = make_case(150, 16, 64, 90, 200, seed=55, topk=True, sink="random")
    monkeypatch.setattr(ref_kernel, "SKIP_EMPTY_BLOCKS_ON_CPU", False)
    leaves = {k: case[k].detach().clone().requires_grad_(True) for k in ("q", "kv", "attn_sink")}
    out, _, _ = sparse_attention(**{**case, **leaves}, backend="reference")
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    with forbid_host_sync():
        torch.autograd.backward(out, w)
    assert all(leaves[k].grad is not None and torch.isfinite(leaves[k].grad).all() for k in leaves)


def _dropout_mask(T, H, K, p, seed, dtype=torch.float64):
    """The mask the reference kernel draws, laid out (T, H, K)."""
    tile = ref_kernel.token_tile(H, 64, dtype)
    heads = -(-H // 16) * 16
    drop = ref_kernel._Dropout(p, seed, (tile, heads, ref_kernel.KEY_BLOCK), dtype, torch.device("cpu"))
    nb = -(-K // ref_kernel.KEY_BLOCK)
    keep = torch.zeros(T, H, nb * ref_kernel.KEY_BLOCK, dtype=dtype)
    for t0 in range(0, T, tile):
        n = min(tile, T - t0)
        for b in range(nb):
            keep[t0 : t0 + n, :, b * ref_kernel.KEY_BLOCK : (b + 1) * ref_kernel.KEY_BLOCK] = (
                drop.keep_scale(t0, b)[:n, :H] * (1 - p)
            )
    return keep[:, :, :K]


def test_dropout_is_eagers_formula_and_its_backward_regenerates_the_mask(monkeypatch):
    """out = sum_j dropout(P_j) v_j with P = softmax([logits, sink]) (sink column dropped, kept
    probabilities scaled by 1 / (1 - p), the denominator untouched), the mask drawn per token tile
    and key block from the seed; the backward uses the same mask."""
    p, seed = 0.3, 1234
    T, H, D, S, K = 70, 3, 64, 40, 150
    case = make_case(T, H, D, S, K, seed=53, dtype=torch.float64, topk=True, sink="random")
    case["attn_sink"] = case["attn_sink"].double()
    monkeypatch.setattr("dsv4_torch.attention._dropout_seed", lambda: seed)
    keep = _dropout_mask(T, H, K, p, seed)
    assert 0.6 < keep.mean().item() < 0.8  # about 1 - p kept
    out, ours = _grads(lambda a: _ours(a, dropout_p=p), case)
    want_out, want = _grads(lambda a: dense_attention(
        a["q"], a["kv"], a["indices"], a["sm_scale"], a["attn_sink"], a["topk_length"], keep=keep, p=p), case)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    for k in want:
        assert ((ours[k] - want[k]).abs().max() / want[k].abs().max()).item() < 1e-12, k
    with torch.no_grad():
        nograd, _, _ = sparse_attention(**case, backend="reference", dropout_p=p)
    assert torch.equal(nograd, out)
    with pytest.raises(ValueError, match=r"dropout_p: expected a float in \[0, 1\)"):
        sparse_attention(**case, backend="reference", dropout_p=1.0)


def test_dropout_seed_follows_torch_manual_seed():
    case = make_case(20, 4, 16, 10, 30, seed=54)
    torch.manual_seed(7)
    a = sparse_attention(**case, backend="reference", dropout_p=0.5)[0]
    b = sparse_attention(**case, backend="reference", dropout_p=0.5)[0]
    torch.manual_seed(7)
    c = sparse_attention(**case, backend="reference", dropout_p=0.5)[0]
    assert torch.equal(a, c) and not torch.equal(a, b)


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
        (lambda c: c.update(indices=c["indices"][:, None].expand(3, 2, 8)), ValueError, r"indices: expected shape \(T, 1, K\)"),
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
