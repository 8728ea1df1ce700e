"""The framework-free CPU kernels (dsv4_cpu, through its ctypes binding) on
NumPy arrays: instruction-set choice, the fp8 slot decoder of every set, sparse attention on every
set against the float64 oracle, thread invariance, argument errors, a forked child.

The PyTorch and JAX wrappers (backend "cpu") have their own tests; this file checks the C layer
itself, so a bug shows up here with the fewest layers in between.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os

import ml_dtypes
import numpy as np
import pytest

from dsv4_cpu import binding as C
from planner import oracle

LIB = C.library()
RUNNABLE = [isa for isa, ok in C.isa_supported().items() if ok]


def _ptr(a):
    return None if a is None else a.ctypes.data


def attend(q, kv, idx, scale, sink=None, topk_length=None, *, isa=None, threads=2):
    """dsv4_sparse_attention on NumPy arrays (bf16 as ml_dtypes.bfloat16, or float32)."""
    T, H, D = q.shape
    dv = 512 if D >= 512 else D
    out = np.zeros((T, H, dv), q.dtype)
    mx = np.zeros((T, H), np.float32)
    lse = np.zeros((T, H), np.float32)
    o = C.Outputs(out.ctypes.data, H * dv, dv, mx.ctypes.data, lse.ctypes.data, H)
    dtype = C.F32 if q.dtype == np.float32 else C.BF16
    rc = LIB.dsv4_sparse_attention(
        q.ctypes.data,
        H * D,
        D,
        dtype,
        T,
        H,
        D,
        kv.ctypes.data,
        D,
        kv.shape[0],
        idx.ctypes.data,
        idx.shape[1],
        idx.shape[1],
        _ptr(topk_length),
        scale,
        _ptr(sink),
        ctypes.byref(o),
        ctypes.byref(C.parallel(threads)),
        C.isa_code(isa),
    )
    C.check(rc)
    return out, mx, lse


def _case(seed, T, H, D, S, K, dtype):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, D)).astype(dtype)
    kv = (rng.standard_normal((S, D)) * 0.5).astype(dtype)
    idx = rng.integers(-3, S + 3, (T, K)).astype(np.int32)
    idx[0, : K // 4] = idx[0, K // 4]  # duplicates count once per occurrence
    topk_length = rng.integers(0, K + 2, T).astype(np.int32)
    topk_length[-1] = 0  # a row with no valid key
    sink = rng.standard_normal(H).astype(np.float32)
    return q, kv, idx, sink, topk_length


def test_instruction_sets(monkeypatch):
    monkeypatch.delenv("DSV4_PREFILL_CPU_ISA", raising=False)  # the machine's own choice
    sets = C.isa_supported()
    assert sets["generic"] and not sets["amx"]  # amx: no kernel is built for it
    assert C.best_isa(C.BF16) == max(RUNNABLE, key=C.ISAS.index)
    if "avx512bf16" in RUNNABLE:  # its bf16 dot product serves bf16; float32 runs avx512's kernel
        assert C.best_isa(C.F32) == "avx512"


def test_environment_caps_the_choice(monkeypatch):
    for isa in RUNNABLE:
        monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", isa)
        assert C.best_isa(C.BF16) == isa
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="DSV4_PREFILL_CPU_ISA.*sse9"):
        C.best_isa()
    q, kv, idx, sink, tl = _case(0, 2, 16, 64, 20, 8, np.float32)
    with pytest.raises(RuntimeError, match="DSV4_PREFILL_CPU_ISA.*sse9"):
        attend(q, kv, idx, 0.1, sink, tl)


def test_a_set_the_machine_lacks_is_refused():
    q, kv, idx, sink, tl = _case(0, 2, 16, 64, 20, 8, np.float32)
    with pytest.raises(RuntimeError, match="amx cannot run"):
        attend(q, kv, idx, 0.1, sink, tl, isa="amx")
    with pytest.raises(ValueError, match="isa"):
        C.isa_code("avx1024")


@pytest.mark.parametrize("isa", [i for i in RUNNABLE])
def test_fp8_decoder_is_bit_exact(isa):
    """The staging decoder of every set == dsv4_decode_row_bf16 == planner.kvcache's reference,
    for every e4m3 code under every scale byte (the fast path's range 10..246 and beyond)."""
    from planner.kvcache import decode_slots, page_bytes

    rng = np.random.default_rng(1)
    S = 2
    page = np.zeros((1, page_bytes(S)), np.uint8)
    got, exact = np.zeros(512, np.uint16), np.zeros(512, np.uint16)
    for byte in range(256):
        d = np.concatenate(
            [np.resize(np.roll(np.arange(256, dtype=np.uint8), byte), 448), rng.integers(0, 256, 128).astype(np.uint8)]
        )
        sc = np.array([byte, (byte + 1) % 256, 9, 10, 246, 247, (byte * 7) % 256, 0], np.uint8)
        page[0, :576], page[0, S * 576 : S * 576 + 8] = d, sc
        LIB.dsv4_decode_row_bf16(d.ctypes.data, sc.ctypes.data, exact.ctypes.data)
        C.check(LIB.dsv4_cpu_decode_row(C.isa_code(isa), d.ctypes.data, sc.ctypes.data, got.ctypes.data))
        with np.errstate(invalid="ignore"):  # NaN codes
            ref = decode_slots(page, S, np.array([0]), np.array([0]))[0].astype(ml_dtypes.bfloat16).view(np.uint16)
        np.testing.assert_array_equal(got, exact, err_msg=f"scale byte {byte}")
        nan = np.isnan(ref.view(ml_dtypes.bfloat16).astype(np.float32))
        np.testing.assert_array_equal(exact[~nan], ref[~nan], err_msg=f"scale byte {byte}")
        assert np.all(exact[:448][nan[:448]] == 0x7FC0)  # decoded NaNs are 0x7FC0 (RoPE bytes are copied)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize(
    "shape",
    [(5, 64, 512, 300, 256), (3, 16, 576, 200, 130), (4, 8, 512, 90, 70), (3, 20, 64, 50, 40), (3, 5, 30, 40, 33)],
)
def test_attention_float32_matches_the_oracle(isa, shape):
    T, H, D, S, K = shape
    q, kv, idx, sink, tl = _case(sum(shape), T, H, D, S, K, np.float32)
    out, mx, lse = attend(q, kv, idx, D**-0.5, sink, tl, isa=isa)
    ro, rm, rl = oracle.sparse_attention(q, kv, idx, D**-0.5, sink, tl)
    scale = max(1.0, float(np.abs(ro).max()))
    np.testing.assert_allclose(out, ro, atol=1e-5 * scale, rtol=0)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(rl))
    finite = np.isfinite(rl)
    np.testing.assert_allclose(lse[finite], rl[finite], atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(mx[finite], rm[finite], atol=1e-5, rtol=1e-6)
    assert np.all(mx[~finite] == -np.inf) and np.all(out[tl == 0] == 0)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_attention_bf16_within_flashmla_tolerance(isa):
    """bf16 in: bf16 products, fp32 accumulation, probabilities in bf16 before PV; FlashMLA's test
    bound (abs 8e-4 or rel 3/128 per element) against fp32 math on the same bf16 inputs."""
    rng = np.random.default_rng(7)
    T, H, D, S, K = 6, 64, 576, 400, 256
    q = (rng.standard_normal((T, H, D)) / 10).astype(ml_dtypes.bfloat16)
    kv = (rng.standard_normal((S, D)) / 10).astype(ml_dtypes.bfloat16)
    idx = rng.integers(-1, S, (T, K)).astype(np.int32)
    sink = rng.standard_normal(H).astype(np.float32)
    out, _, lse = attend(q, kv, idx, D**-0.5, sink, None, isa=isa)
    ro, _, rl = oracle.sparse_attention(q.astype(np.float64), kv.astype(np.float64), idx, D**-0.5, sink)
    err = np.abs(out.astype(np.float64) - ro)
    assert np.all((err <= 8e-4) | (err <= 3 / 128 * np.abs(ro))), float(err.max())
    np.testing.assert_allclose(lse, rl, atol=1e-4)


def test_sinks_and_empty_rows():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 16, 64)).astype(np.float32)
    kv = rng.standard_normal((10, 64)).astype(np.float32)
    idx = np.tile(np.arange(8, dtype=np.int32), (4, 1))
    for sink in (np.full(16, -np.inf, np.float32), np.full(16, 80.0, np.float32), np.full(16, 1e30, np.float32)):
        out, _, _ = attend(q, kv, idx, 0.125, sink)
        with np.errstate(over="ignore"):  # exp(1e30 - lse) = inf: the output is 0
            ro, _, _ = oracle.sparse_attention(q, kv, idx, 0.125, sink)
        np.testing.assert_allclose(out, ro, atol=1e-6)
    out, mx, lse = attend(q, kv, np.full((4, 8), -1, np.int32), 0.125)
    assert np.all(out == 0) and np.all(lse == np.inf) and np.all(mx == -np.inf)


def test_threads_and_sets_do_not_change_a_token_result():
    """A token's bits depend on its keys only: any thread count gives the same output."""
    q, kv, idx, sink, tl = _case(5, 37, 64, 512, 300, 200, ml_dtypes.bfloat16)
    one = attend(q, kv, idx, 0.05, sink, tl, threads=1)
    for threads in (2, 3, 8):
        for a, b in zip(one, attend(q, kv, idx, 0.05, sink, tl, threads=threads)):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_bad_arguments_name_themselves():
    q, kv, idx, sink, tl = _case(0, 2, 16, 64, 20, 8, np.float32)
    o = C.Outputs(None, 0, 0, None, None, 0)
    rc = LIB.dsv4_sparse_attention(
        q.ctypes.data,
        1024,
        64,
        1,
        2,
        16,
        64,
        kv.ctypes.data,
        64,
        20,
        idx.ctypes.data,
        8,
        8,
        None,
        0.1,
        None,
        ctypes.byref(o),
        ctypes.byref(C.parallel(1)),
        -1,
    )
    with pytest.raises(ValueError, match="out: NULL"):
        C.check(rc)
    for args, what in (((0, 16, 64, 1), "dtype"), ((1, 0, 64, 1), "H: expected >= 1"), ((1, 16, 64, 0), "par.threads")):
        dt, H, D, th = args
        rc = LIB.dsv4_sparse_attention(
            q.ctypes.data,
            1024,
            64,
            5 if what == "dtype" else dt,
            2,
            H,
            D,
            kv.ctypes.data,
            64,
            20,
            idx.ctypes.data,
            8,
            8,
            None,
            0.1,
            None,
            ctypes.byref(o),
            ctypes.byref(C.Parallel(th, None, None, None)),
            -1,
        )
        with pytest.raises(ValueError, match=what):
            C.check(rc)


def _child_call(conn):
    q, kv, idx, sink, tl = _case(9, 40, 16, 64, 50, 30, np.float32)
    conn.send(attend(q, kv, idx, 0.1, sink, tl, threads=2)[0])


def test_a_forked_child_runs_the_kernel():
    """The thread pool starts afresh in a forked child (its workers are not inherited)."""
    q, kv, idx, sink, tl = _case(9, 40, 16, 64, 50, 30, np.float32)
    want = attend(q, kv, idx, 0.1, sink, tl, threads=2)[0]  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_child_call, args=(b,))
    p.start()
    assert a.poll(300), "the forked child did not answer in 300 s"
    np.testing.assert_array_equal(a.recv(), want)
    p.join(10)
    assert p.exitcode == 0


def test_build_without_a_compiler_says_why(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), DSV4_PREFILL_CACHE=str(tmp_path))
    code = "from dsv4_cpu import binding as C; print(C.unavailable_reason())"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "no C compiler found" in res.stdout and "no-such-cc" in res.stdout
