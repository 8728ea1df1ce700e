"""The torch backend "cpu" (`dsv4_torch.kernels.cpu.attention`, the C kernel of `dsv4_cpu`) of
`sparse_attention`: FlashMLA's contract against the float64 oracle, on every instruction set this
machine runs (DSV4_PREFILL_CPU_ISA caps the kernel's choice; `dsv4_cpu.isa_supported()`).

Tolerances (tests/parity/tolerances.py, the parity table):
- float32 inputs: out within 1e-5 of the oracle relative to the largest |out| of the call;
  lse / max_logits within 1e-5 * max(1, |ref|).
- bf16 inputs: FlashMLA's test check against the float64 oracle on the same bf16-rounded inputs
  (each element within abs 8e-4 or rel 3/128, cosine diff <= 7e-6, data at FlashMLA's scale
  kv ~ N(0, 0.1^2)); lse / max_logits within 1e-4 * max(1, |ref|).
- The +inf / -inf pattern of lse / max_logits (rows without a valid key) exactly.
A token's result depends only on its own keys: bitwise the same under any thread count, token
subset or strides.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from dsv4_cpu import binding as ckernel
from dsv4_torch import BackendUnavailableError, available_backends, resolve_backend, sparse_attention
from dsv4_torch.kernels.cpu import attention as CA
from dsv4_torch.kernels.cpu import library as kcpu_library
from planner import oracle
from tests.parity import cases as C
from tests.parity import tolerances as TOL

_REASON = ckernel.unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"the C kernel cannot be built here: {_REASON}")
ISAS = [] if _REASON is not None else [isa for isa, ok in ckernel.isa_supported().items() if ok]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Every instruction set this machine runs, forced through DSV4_PREFILL_CPU_ISA."""
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", request.param)
    assert ckernel.best_isa(ckernel.BF16) == request.param
    return request.param


# ----------------------------------------------------------------------------- helpers


def case(T, H, D, S, K, *, dtype="float32", seed=0, invalid=0.2, duplicates=0.1, sink="random", topk=False):
    """Inputs as torch tensors (q, kv rounded to dtype) at the parity suite's data scale."""
    rng = np.random.default_rng(seed)
    q, kv = C.random_inputs(rng, T, H, D, S, dtype)
    idx = C.random_indices(rng, T, S, K, invalid=invalid, duplicates=duplicates)
    s = C.random_sink(rng, H, sink)
    tl = rng.integers(-2, K + 5, T).astype(np.int32) if topk else None
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return dict(
        q=t(q).to(DTYPES[dtype]),
        kv=t(kv).to(DTYPES[dtype]),
        indices=t(idx),
        sm_scale=D**-0.5,
        attn_sink=t(s),
        topk_length=t(tl),
    )


def run_oracle(c):
    f64 = lambda t: None if t is None else t.detach().double().numpy()  # noqa: E731
    return oracle.sparse_attention(
        f64(c["q"]),
        f64(c["kv"]),
        c["indices"].numpy(),
        c["sm_scale"],
        f64(c["attn_sink"]),
        None if c["topk_length"] is None else c["topk_length"].numpy(),
    )


def check(c, **kw):
    """Run backend "cpu" on case c, compare with the oracle under the parity table; returns the
    outputs (torch) and the oracle's (NumPy)."""
    got = sparse_attention(**c, backend="cpu", **kw)
    out, max_logits, lse = got
    T, H, D = c["q"].shape
    assert out.dtype == c["q"].dtype and out.shape == (T, H, min(D, 512))
    assert max_logits.dtype == lse.dtype == torch.float32 and max_logits.shape == lse.shape == (T, H)
    want = run_oracle(c)
    dtype = "bfloat16" if c["q"].dtype == torch.bfloat16 else "float32"
    g = [x.detach().double().numpy() for x in got]
    checks = [
        TOL.compare_out(g[0], want[0], want[0], dtype),
        TOL.compare_stat(g[1], want[1], want[1], dtype, "max_logits"),
        TOL.compare_stat(g[2], want[2], want[2], dtype, "lse"),
    ]
    bad = [x.detail for x in checks if not x.passed]
    assert not bad, bad
    return got, want


def same_bits(a, b):
    return all(
        torch.equal(
            x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32),
            y.view(torch.int16) if y.dtype == torch.bfloat16 else y.view(torch.int32),
        )
        for x, y in zip(a, b)
    )


# ----------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("H", [16, 20, 64, 128])
@pytest.mark.parametrize("D", [512, 576, 64, 33])
def test_random_inputs_every_shape(isa, dtype, H, D):
    c = case(5, H, D, 300, 150, dtype=dtype, seed=H * 1000 + D, topk=True)
    check(c)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_dim_above_512_not_576(isa, dtype):
    (out, _, _), _ = check(case(3, 16, 600, 50, 70, dtype=dtype, seed=1))
    assert out.shape == (3, 16, 512)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the oracle's exp(1e4 - lse)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sink", [None, float("-inf"), 0.0, 30.0, 1e4, float("inf"), "mixed"])
def test_sinks(isa, dtype, sink):
    c = case(6, 16, 64, 40, 128, dtype=dtype, seed=5, sink=sink, invalid=0.1)
    got, _ = check(c)
    out, _, lse = got
    if sink == float("-inf"):  # -inf = no sink: the very same bits
        assert same_bits(sparse_attention(**{**c, "attn_sink": None}, backend="cpu"), got)
    if sink in (1e4, float("inf")):  # the sink takes all the weight; lse leaves it out
        assert not out.any() and torch.isfinite(lse).all()
    if sink == "mixed":
        assert not out[:, 3:5].any()  # heads 3, 4: sinks 200 and +inf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_topk_length_cuts_and_overflows(isa, dtype):
    T, H, D, S, K = 7, 16, 64, 60, 256
    c = case(T, H, D, S, K, dtype=dtype, seed=7, invalid=0.0, duplicates=0.0)
    c["topk_length"] = torch.tensor([0, 1, 37, 128, 255, 300, -4], dtype=torch.int32)  # 0, < K, > K, negative
    (out, max_logits, lse), _ = check(c)
    for t in (0, 6):  # nothing valid: out 0, lse +inf, max_logits -inf
        assert not out[t].any() and torch.isposinf(lse[t]).all() and torch.isneginf(max_logits[t]).all()
    cut = {**c, "topk_length": None, "indices": c["indices"].clone()}
    cut["indices"][2, 37:] = -1  # cutting at topk_length == dropping the columns
    assert torch.equal(sparse_attention(**cut, backend="cpu")[0][2], out[2])
    full = {**c, "topk_length": None}
    assert torch.equal(sparse_attention(**full, backend="cpu")[0][5], out[5])  # topk_length > K: all K


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invalid_indices_and_rows_without_keys(isa, dtype):
    T, H, D, S, K = 8, 16, 64, 30, 200
    c = case(T, H, D, S, K, dtype=dtype, seed=6, invalid=0.3)
    idx = c["indices"]
    idx[0] = -1
    idx[1] = -5
    idx[2] = S
    idx[3] = torch.arange(S, S + K, dtype=torch.int32)
    idx[4] = C.INT32_MAX
    idx[5] = C.INT32_MIN
    (out, max_logits, lse), _ = check(c)
    assert not out[:6].any() and torch.isposinf(lse[:6]).all() and torch.isneginf(max_logits[:6]).all()
    assert torch.isfinite(lse[6:]).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_duplicated_indices_count_each_time(isa, dtype):
    T, H, D, S, K = 4, 16, 64, 10, 64
    c = case(T, H, D, S, K, dtype=dtype, seed=8, invalid=0.0, duplicates=0.0, sink=None)
    c["indices"][:, :] = 3
    c["indices"][:, 16:] = 7  # 16 copies of row 3, 48 of row 7
    (_, _, lse), _ = check(c)
    q, kv = c["q"].double(), c["kv"].double()
    a, b = (q @ kv[3]) * c["sm_scale"], (q @ kv[7]) * c["sm_scale"]
    want = torch.logaddexp(a + np.log(16), b + np.log(48))
    torch.testing.assert_close(lse.double(), want, rtol=1e-4 if dtype == "bfloat16" else 1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_inputs_propagate_like_the_oracle(isa, dtype):
    """NaN in one token's q head or in a gathered kv row (every head of that token) gives NaN in
    exactly the oracle's rows; unreferenced NaN rows do nothing; a token without a valid key stays
    0 / -inf / +inf even with NaN queries."""
    T, H, D, S, K = 6, 16, 64, 40, 96
    c = case(T, H, D, S, K, dtype=dtype, seed=21, invalid=0.2, duplicates=0.0)
    idx, q, kv = c["indices"], c["q"], c["kv"]
    idx[(idx == S - 1) | (idx == 0)] = 1  # row S-1 is read by token 2 only; row 0 by nobody
    idx[2, 70] = S - 1
    kv[S - 1, 5] = float("nan")
    kv[0] = float("nan")
    q[1, 3, 7] = float("nan")  # token 1, head 3
    q[4, :, 0] = float("nan")  # token 4: NaN queries, no valid key
    idx[4] = -1
    got = [x.double().numpy() for x in sparse_attention(**c, backend="cpu")]
    want = run_oracle(c)
    for name, g, w in zip(("out", "max_logits", "lse"), got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{name}: NaN pattern")
    assert np.isnan(want[0][1, 3]).all() and np.isnan(want[0][2]).all() and not np.isnan(want[0][[0, 3, 4, 5]]).any()
    assert (got[0][4] == 0).all() and np.isposinf(got[2][4]).all() and np.isneginf(got[1][4]).all()
    keep = [0, 3, 5]
    dt = "bfloat16" if dtype == "bfloat16" else "float32"
    assert TOL.compare_out(got[0][keep], want[0][keep], want[0][keep], dt).passed
    assert TOL.compare_stat(got[2][keep], want[2][keep], want[2][keep], dt, "lse").passed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_shaped_call(isa, dtype):
    """One token per request (T = batch), V4-Flash heads and width: each token its own keys."""
    B, H, D, S, K = 24, 64, 512, 6000, 640
    c = case(B, H, D, S, K, dtype=dtype, seed=30, invalid=0.05)
    rng = np.random.default_rng(31)
    c["topk_length"] = torch.from_numpy(rng.integers(1, K + 1, B).astype(np.int32))
    check(c)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prefill_many_tokens(isa, dtype):
    """Hundreds of tokens (many work items over the threads), windows shared between neighbours."""
    T, H, D, W = 400, 16, 128, 128
    c = case(T, H, D, T, W, dtype=dtype, seed=40, invalid=0.0, duplicates=0.0)
    p = torch.arange(T, dtype=torch.int32)[:, None]
    col = torch.arange(W, dtype=torch.int32)[None, :]
    c["indices"] = torch.where(col <= p, (p - col), -1).to(torch.int32)  # causal sliding window
    c["topk_length"] = torch.clamp(p[:, 0] + 1, max=W).to(torch.int32)
    check(c)


# FlashMLA's own test data (tests/jax/test_mosaic.py reproduces them the same way): kv ~ N(0, 0.1^2),
# every invalid form, duplicates, a -1 padded tail past each row's topk_length, and a sink per head
# covering -inf, 0, 30, 1e4, +inf; every head count FlashMLA serves, D 512 / 576, top-k 512-2048.
FLASHMLA_CASES = [
    (16, 576, 512, [512, 300, 0]),
    (32, 512, 1024, [1024, 129]),
    (64, 576, 2048, [2048]),
    (128, 512, 1152, [1152]),
    (128, 576, 512, [512, 33]),
]


def flashmla_case(seed, T, H, D, S, K, topk_length, invalid=0.2, duplicates=0.2):
    rng = np.random.default_rng(seed)
    q, kv = C.random_inputs(rng, T, H, D, S, "bfloat16")
    idx = C.random_indices(rng, T, S, K, invalid=invalid, duplicates=duplicates)
    tl = np.asarray(topk_length, np.int32)
    idx[np.arange(K)[None, :] >= tl[:, None]] = -1
    special = np.array([-np.inf, 0.0, 30.0, 1e4, np.inf], np.float32)
    sink = np.concatenate([special, rng.standard_normal(H - len(special)).astype(np.float32)])
    t = torch.from_numpy
    return dict(
        q=t(q).bfloat16(), kv=t(kv).bfloat16(), indices=t(idx), sm_scale=D**-0.5, attn_sink=t(sink), topk_length=t(tl)
    )


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(
    "H, D, K, topk_length", FLASHMLA_CASES, ids=[f"H{c[0]}-D{c[1]}-K{c[2]}" for c in FLASHMLA_CASES]
)
def test_flashmla_cases(isa, H, D, K, topk_length):
    c = flashmla_case(H + D + K, len(topk_length), H, D, 4000, K, topk_length)
    (out, max_logits, lse), _ = check(c)
    assert not out[:, 3:5].any()  # sinks 1e4 and +inf take all the weight
    if 0 in topk_length:
        t = topk_length.index(0)
        assert not out[t].any() and torch.isneginf(max_logits[t]).all() and torch.isposinf(lse[t]).all()


# ----------------------------------------------------------------------------- invariances


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_bits_for_any_threads_and_token_subset(isa, dtype):
    c = case(70, 20, 64, 200, 160, dtype=dtype, seed=50, topk=True)
    full = CA.sparse_attention_cpu(**c, threads=1)
    for threads in (2, 3, 8):
        assert same_bits(CA.sparse_attention_cpu(**c, threads=threads), full), threads
    for lo, hi in ((0, 1), (13, 14), (5, 61), (69, 70)):
        sub = {**c, "q": c["q"][lo:hi], "indices": c["indices"][lo:hi], "topk_length": c["topk_length"][lo:hi]}
        assert same_bits(sparse_attention(**sub, backend="cpu"), tuple(x[lo:hi] for x in full)), (lo, hi)


def test_isa_argument_equals_the_environment_cap(isa, monkeypatch):
    c = case(9, 16, 64, 50, 100, dtype="bfloat16", seed=51, topk=True)
    capped = sparse_attention(**c, backend="cpu")
    monkeypatch.delenv("DSV4_PREFILL_CPU_ISA")
    assert same_bits(CA.sparse_attention_cpu(**c, isa=isa), capped)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_strided_inputs_give_the_same_bits(dtype):
    c = case(5, 16, 64, 40, 64, dtype=dtype, seed=11, topk=True)
    want = sparse_attention(**c, backend="cpu")
    strided = {
        **c,
        "q": c["q"].transpose(0, 1).contiguous().transpose(0, 1),  # H-major storage
        "kv": torch.cat([c["kv"], c["kv"]], dim=1)[:, :64],  # row stride 128
        "indices": c["indices"].t().contiguous().t(),  # column-major: copied
        "topk_length": torch.stack([c["topk_length"], c["topk_length"]], 1)[:, 0],  # stride 2
    }
    assert not strided["q"].is_contiguous() and not strided["kv"].is_contiguous()
    assert same_bits(sparse_attention(**strided, backend="cpu"), want)
    last = {**c, "q": torch.stack([c["q"], c["q"]], -1)[..., 0], "kv": torch.stack([c["kv"], -c["kv"]], -1)[..., 0]}
    assert last["q"].stride(-1) == 2 and last["kv"].stride(-1) == 2  # last dim not contiguous: copied
    assert same_bits(sparse_attention(**last, backend="cpu"), want)
    shaped = {**c, "kv": c["kv"][:, None, :], "indices": c["indices"][:, None, :]}  # FlashMLA's (S,1,D), (T,1,K)
    assert same_bits(sparse_attention(**shaped, backend="cpu"), want)


def test_float64_sink_is_read_as_float32():
    c = case(4, 16, 64, 40, 64, seed=12)
    want = sparse_attention(**c, backend="cpu")
    assert same_bits(sparse_attention(**{**c, "attn_sink": c["attn_sink"].double()}, backend="cpu"), want)


def test_zero_tokens_and_heads_never_reach_the_kernel(monkeypatch):
    def refuse():
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(CA, "library", refuse)
    for T, H in ((0, 16), (3, 0)):
        c = case(T, max(H, 1), 64, 10, 16, seed=13)
        c["q"] = torch.zeros(T, H, 64)
        c["attn_sink"] = None
        out, max_logits, lse = sparse_attention(**c, backend="cpu")
        assert out.shape == (T, H, 64) and max_logits.shape == lse.shape == (T, H)
        assert max_logits.dtype == torch.float32


# ----------------------------------------------------------------------------- backend choice


def test_auto_picks_cpu_for_bf16_and_fp32_on_cpu(caplog):
    for dtype in (torch.bfloat16, torch.float32):
        assert resolve_backend("auto", torch.zeros(1, 16, 64, dtype=dtype)) == "cpu"
        assert resolve_backend("cpu", torch.zeros(1, 16, 64, dtype=dtype)) == "cpu"
    for dtype in (torch.float16, torch.float64):
        q = torch.zeros(1, 16, 64, dtype=dtype)
        assert resolve_backend("auto", q) == "reference"
        with pytest.raises(TypeError, match=f"q: backend='cpu' takes bfloat16 / float32, got {dtype}"):
            resolve_backend("cpu", q)
    with caplog.at_level(logging.DEBUG, logger="dsv4_torch"):
        sparse_attention(**case(2, 16, 64, 10, 16, seed=14))
    assert any("backend=cpu (asked 'auto')" in r.getMessage() for r in caplog.records)
    assert available_backends()["cpu"] is None


def test_cpu_refuses_other_devices():
    q = torch.zeros(1, 16, 64, device="meta")
    with pytest.raises(BackendUnavailableError, match="tensors on meta: the cpu backend reads CPU tensors"):
        resolve_backend("cpu", q)
    assert resolve_backend("auto", q) == "reference"


def test_gradient_or_dropout_goes_to_reference():
    c = case(4, 16, 64, 20, 32, seed=15)
    q = c["q"].clone().requires_grad_()
    assert resolve_backend("auto", q, needs_grad=True) == "reference"
    assert resolve_backend("auto", q, dropout_p=0.1) == "reference"
    with pytest.raises(BackendUnavailableError, match="backend='cpu' has no backward"):
        sparse_attention(**{**c, "q": q}, backend="cpu")
    with pytest.raises(BackendUnavailableError, match="backend='cpu' has no attention dropout"):
        sparse_attention(**c, backend="cpu", dropout_p=0.1)
    out = sparse_attention(**{**c, "q": q})[0]  # auto: the reference backend, with its backward
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    with torch.no_grad():  # no gradient needed: the kernel runs
        assert same_bits(sparse_attention(**{**c, "q": q}, backend="cpu"), sparse_attention(**c, backend="cpu"))


def test_kernel_that_cannot_build_is_reported(monkeypatch):
    monkeypatch.setattr(
        kcpu_library, "_state", {"error": "RuntimeError: no C compiler found ('cc' is not on PATH; set CC)"}
    )
    q = torch.zeros(1, 16, 64)
    assert resolve_backend("auto", q) == "reference"
    with pytest.raises(BackendUnavailableError, match="backend='cpu' cannot run here: RuntimeError: no C compiler"):
        resolve_backend("cpu", q)
    assert available_backends()["cpu"].startswith("RuntimeError: no C compiler")


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs_name_the_argument(monkeypatch):
    c = case(3, 16, 64, 20, 32, seed=16, topk=True)
    bad = [
        ({"kv": c["kv"].double()}, TypeError, "kv: dtype"),
        ({"indices": c["indices"].long()}, TypeError, "indices: expected int32"),
        ({"topk_length": c["topk_length"][:2]}, ValueError, "topk_length: expected shape"),
        ({"attn_sink": c["attn_sink"][:3]}, ValueError, "attn_sink: expected shape"),
        ({"attn_sink": c["attn_sink"].half()}, TypeError, "attn_sink: expected float32"),
        ({"sm_scale": float("nan")}, ValueError, "sm_scale: must be finite"),
        ({"q": c["q"][:, :, :32]}, ValueError, "kv: last dim"),
    ]
    for change, exc, match in bad:
        with pytest.raises(exc, match=match):
            sparse_attention(**{**c, **change}, backend="cpu")
    with pytest.raises(TypeError, match="q: the cpu backend takes bfloat16 or float32"):
        CA.sparse_attention_cpu(**{**c, "q": c["q"].half(), "kv": c["kv"].half()})
    with pytest.raises(ValueError, match="isa: expected one of"):
        CA.sparse_attention_cpu(**c, isa="sse2")
    if not ckernel.isa_supported()["amx"]:
        with pytest.raises(RuntimeError, match="amx cannot run on this machine"):
            CA.sparse_attention_cpu(**c, isa="amx")
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", "sse2")
    with pytest.raises(RuntimeError, match="DSV4_PREFILL_CPU_ISA: unknown instruction set 'sse2'"):
        sparse_attention(**c, backend="cpu")


def test_torch_parallel_for_runs_on_torch_threads():
    """`dsv4_torch_parallel_run` (the kernels' parallel-for under torch) spreads its items over
    torch's intra-op threads: compiled without OpenMP, at::parallel_for's inline pragma is dropped
    and every item ran on the calling thread (the kernels then used one core of two)."""
    import ctypes
    import threading

    from dsv4_torch.kernels.cpu import library as kcpu

    if kcpu.unavailable_reason() is not None:
        pytest.skip(f"the C kernels do not build here: {kcpu.unavailable_reason()}")
    seen = set()
    fn_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)
    fn = fn_t(lambda arg, i: seen.add(threading.get_native_id()))
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, fn_t, ctypes.c_void_p)(kcpu.runner())
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run(None, 64, fn, None)
    finally:
        torch.set_num_threads(before)
    assert len(seen) == 2, f"64 items ran on {len(seen)} thread(s) with torch.get_num_threads() == 2"
