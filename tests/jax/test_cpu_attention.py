"""dsv4_jax's sparse-attention backend "cpu" (the C kernel of dsv4_cpu as an XLA FFI call).

The FlashMLA contract against the float64 oracle on every instruction set this machine runs
(`DSV4_PREFILL_CPU_ISA` caps the choice; the C code reads it on every call): sinks (none, -inf,
large), topk_length, invalid and duplicate indices, rows without a valid key, H 16..128, D 512 /
576 / small, lse and max_logits, decode-shaped calls; eager == jax.jit bit for bit; torch and
JAX give identical bits (the same inputs through DLPack, the kernel torch calls through ctypes);
backend resolution; no silent gradient. The prefill layer call: tests/jax/test_prefill_cpu.py.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv4_jax
from dsv4_cpu import binding as ckernel
from dsv4_jax.kernels.cpu import attention as cpu_attention
from dsv4_jax.kernels.cpu import library as cpu_library
from planner import oracle

if (_reason := cpu_library.unavailable_reason()) is not None:
    pytest.skip(f"the C kernel cannot be built here: {_reason}", allow_module_level=True)

ISAS = [isa for isa, ok in ckernel.isa_supported().items() if ok]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
FP32_REL = 1e-5  # the bound for float32: within 1e-5 of the oracle (relative to its scale)
BF16_ABS, BF16_REL = 8e-4, 3 / 128  # FlashMLA's tolerance against an fp32-or-better reference
SINKS = ("none", "-inf", "large", "random")


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", request.param)
    assert ckernel.best_isa(ckernel.BF16) == request.param  # the cap is what bf16 calls run
    return request.param


def _sink(kind: str, H: int, rng):
    if kind == "none":
        return None
    if kind == "-inf":
        return np.full(H, -np.inf, np.float32)
    if kind == "large":  # the sink swamps the keys: outputs -> 0, lse unchanged
        return np.where(np.arange(H) % 2 == 0, 1e4, 60.0).astype(np.float32)
    return rng.standard_normal(H).astype(np.float32)


def _case(seed, T, H, D, S, K, dtype, sink="random", lengths=True):
    """q, kv in `dtype` (as NumPy float32 holding the rounded values), indices mixing every kind
    of invalid entry with duplicates and a row without a valid key, topk_length, sink."""
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":  # FlashMLA's test data: normal / 10 plus a small offset
        shift = (rng.random() - 0.5) / 10
        q = 0.1 * rng.standard_normal((T, H, D)) + shift
        kv = 0.1 * rng.standard_normal((S, D)) + shift
        q, kv = (x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (q, kv))
    else:
        q = rng.standard_normal((T, H, D)).astype(np.float32)
        kv = rng.standard_normal((S, D)).astype(np.float32)
    idx = rng.integers(0, S, (T, K))
    bad = rng.random((T, K))
    idx = np.where(bad < 0.08, -1, idx)
    idx = np.where((bad >= 0.08) & (bad < 0.12), S + rng.integers(0, 5, (T, K)), idx)
    idx = np.where((bad >= 0.12) & (bad < 0.14), np.iinfo(np.int32).min, idx)
    idx = np.where((bad >= 0.14) & (bad < 0.16), np.iinfo(np.int32).max, idx)
    if K > 3:
        idx[:, 1] = idx[:, 0]  # duplicates count each time
        idx[:, 3] = idx[:, 0]
    idx[T // 2] = -1  # a row without a valid key
    idx = idx.astype(np.int32)
    topk_length = None
    if lengths:
        topk_length = rng.integers(0, K + 3, T).astype(np.int32)
        topk_length[0] = 0  # no key at all
        topk_length[-1] = K + 7  # past K: all K columns
    return q, kv, idx, _sink(sink, H, rng), topk_length


def _run(q, kv, idx, sm_scale, sink, topk_length, dtype, *, jit: bool, backend="cpu"):
    args = [jnp.asarray(q, DTYPES[dtype]), jnp.asarray(kv, DTYPES[dtype]), jnp.asarray(idx)]
    opt = [None if sink is None else jnp.asarray(sink), None if topk_length is None else jnp.asarray(topk_length)]
    f = lambda q, kv, i, s, t: dsv4_jax.sparse_attention(q, kv, i, sm_scale, s, t, backend=backend)  # noqa: E731
    res = (jax.jit(f) if jit else f)(*args, *opt)
    return tuple(np.asarray(x) for x in res)


def _check_oracle(got, q, kv, idx, sm_scale, sink, topk_length, dtype):
    out, max_logits, lse = got
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    ref_out, ref_max, ref_lse = oracle.sparse_attention(f64(q), f64(kv), idx, sm_scale, f64(sink), topk_length)
    assert out.shape == ref_out.shape and out.dtype == jnp.dtype(DTYPES[dtype])
    assert max_logits.dtype == np.float32 and lse.dtype == np.float32
    o = out.astype(np.float64)
    assert not np.isnan(o).any()
    if dtype == "bfloat16":
        err = np.abs(o - ref_out)
        ok = (err <= BF16_ABS) | (err <= BF16_REL * (np.abs(ref_out) + 1e-6))
        assert ok.all(), f"{(~ok).sum()} of {ok.size} outputs off; worst {err.max():.3g}"
    else:
        np.testing.assert_allclose(o, ref_out, rtol=FP32_REL, atol=FP32_REL * max(np.abs(ref_out).max(), 1e-30))
    # rows without a valid key: exactly out 0, lse +inf, max_logits -inf
    empty = np.isposinf(ref_lse)
    np.testing.assert_array_equal(np.isposinf(lse), empty)
    np.testing.assert_array_equal(np.isneginf(max_logits), np.isneginf(ref_max))
    assert not out[empty].astype(np.float64).any()
    fin = np.isfinite(ref_lse)
    tol = 1e-5 if dtype == "float32" else 1e-4
    for got_s, ref_s in ((lse, ref_lse), (max_logits, ref_max)):
        np.testing.assert_array_less(np.abs(got_s[fin] - ref_s[fin]), tol * np.maximum(1.0, np.abs(ref_s[fin])))


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# --- the contract, every instruction set ---------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, D", [(16, 512), (64, 576), (128, 512), (16, 64), (20, 48)])
def test_contract_on_every_isa(isa, dtype, H, D):
    """Random and adversarial indices, topk_length, a sink per head; eager == jit bit for bit."""
    q, kv, idx, sink, tl = _case(H * 1000 + D, T=6, H=H, D=D, S=96, K=160, dtype=dtype)
    scale = D**-0.5
    eager = _run(q, kv, idx, scale, sink, tl, dtype, jit=False)
    _check_oracle(eager, q, kv, idx, scale, sink, tl, dtype)
    jitted = _run(q, kv, idx, scale, sink, tl, dtype, jit=True)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the oracle's exp(1e4 - lse)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink", SINKS)
def test_sinks_and_lengths_on_every_isa(isa, dtype, sink):
    for lengths in (True, False):
        q, kv, idx, s, tl = _case(7, T=9, H=16, D=576, S=300, K=256, dtype=dtype, sink=sink, lengths=lengths)
        got = _run(q, kv, idx, 0.04, s, tl, dtype, jit=True)
        _check_oracle(got, q, kv, idx, 0.04, s, tl, dtype)
        if sink == "large":  # the sink takes (almost) all the weight; lse excludes it
            assert np.abs(got[0][:, ::2].astype(np.float32)).max() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_shaped_calls_on_every_isa(isa, dtype):
    """One token per request, long key lists (every key valid), V4-Flash and V4-Pro head counts."""
    for H, D, K in ((64, 512, 2048), (128, 576, 640)):
        rng = np.random.default_rng(H)
        q, kv, _, sink, _ = _case(H, T=3, H=H, D=D, S=4096, K=4, dtype=dtype, lengths=False)
        idx = np.stack([rng.permutation(4096)[:K] for _ in range(3)]).astype(np.int32)
        got = _run(q, kv, idx, D**-0.5, sink, None, dtype, jit=True)
        _check_oracle(got, q, kv, idx, D**-0.5, sink, None, dtype)


def test_empty_and_degenerate_shapes():
    """T = 0, K = 0 (no key anywhere), S = 0 (every index invalid)."""
    for T, S, K in ((0, 8, 4), (3, 8, 0), (3, 0, 5)):
        q = np.ones((T, 16, 64), np.float32)
        kv = np.ones((S, 64), np.float32)
        idx = np.zeros((T, K), np.int32)
        out, ml, lse = _run(q, kv, idx, 0.1, None, None, "float32", jit=True)
        assert out.shape == (T, 16, 64) and ml.shape == lse.shape == (T, 16)
        assert not out.any() and np.isposinf(lse).all() and np.isneginf(ml).all()


def test_threads_do_not_change_a_bit():
    """XLA's intra-op pool (the FFI handler's threads) gives the bits of one thread (ctypes)."""
    q, kv, idx, sink, tl = _case(3, T=40, H=64, D=512, S=200, K=192, dtype="bfloat16")
    many = _run(q, kv, idx, 0.05, sink, tl, "bfloat16", jit=True)
    T, H, D = q.shape
    q, kv = (np.ascontiguousarray(x.astype(ml_dtypes.bfloat16)) for x in (q, kv))
    idx, tl, sink = (np.ascontiguousarray(x) for x in (idx, tl, sink))
    out = np.zeros((T, H, 512), ml_dtypes.bfloat16)
    ml, lse = np.zeros((T, H), np.float32), np.zeros((T, H), np.float32)
    o = ckernel.Outputs(out.ctypes.data, H * 512, 512, ml.ctypes.data, lse.ctypes.data, H)
    rc = ckernel.library().dsv4_sparse_attention(
        q.ctypes.data,
        H * D,
        D,
        ckernel.BF16,
        T,
        H,
        D,
        kv.ctypes.data,
        D,
        kv.shape[0],
        idx.ctypes.data,
        idx.shape[1],
        idx.shape[1],
        tl.ctypes.data,
        0.05,
        sink.ctypes.data,
        ctypes.byref(o),
        ctypes.byref(ckernel.parallel(1)),
        -1,
    )
    ckernel.check(rc)
    for a, b in zip(many, (out, ml, lse)):
        np.testing.assert_array_equal(_bits(a), _bits(np.asarray(b)))


def test_vmap_runs_each_element():
    q, kv, idx, sink, tl = _case(4, T=4, H=16, D=64, S=50, K=32, dtype="float32")
    qs = jnp.stack([jnp.asarray(q), -jnp.asarray(q)])
    f = lambda q: dsv4_jax.sparse_attention(
        q, jnp.asarray(kv), jnp.asarray(idx), 0.1, jnp.asarray(sink), jnp.asarray(tl), backend="cpu"
    )  # noqa: E731
    batched = jax.vmap(f)(qs)
    for i in range(2):
        for a, b in zip(batched, f(qs[i])):
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b))


# --- torch and JAX: the same bits -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_and_jax_give_identical_bits(dtype):
    """The same tensors (torch, crossed to JAX by DLPack) through the kernel called by ctypes
    (`dsv4_cpu.binding`), through `dsv4_torch.sparse_attention(backend="cpu")` and through JAX's
    FFI call: identical bits in out, max_logits and lse."""
    try:
        import torch
    except ImportError:
        pytest.skip("the torch side needs torch (the jax-only `make test-jax-new` run has none)")
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    q, kv, idx, sink, tl = _case(11, T=10, H=64, D=576, S=256, K=200, dtype=dtype)
    tq, tkv = torch.from_numpy(q).to(tdt), torch.from_numpy(kv).to(tdt)
    tidx, tsink, ttl = torch.from_numpy(idx), torch.from_numpy(sink), torch.from_numpy(tl)
    T, H, D = tq.shape
    out = torch.empty((T, H, 512), dtype=tdt)
    ml, lse = torch.empty((T, H)), torch.empty((T, H))
    outs = ckernel.Outputs(out.data_ptr(), H * 512, 512, ml.data_ptr(), lse.data_ptr(), H)
    lib = ckernel.library()
    code = ckernel.F32 if dtype == "float32" else ckernel.BF16
    rc = lib.dsv4_sparse_attention(
        tq.data_ptr(),
        H * D,
        D,
        code,
        T,
        H,
        D,
        tkv.data_ptr(),
        D,
        tkv.shape[0],
        tidx.data_ptr(),
        idx.shape[1],
        idx.shape[1],
        ttl.data_ptr(),
        0.05,
        tsink.data_ptr(),
        ctypes.byref(outs),
        ctypes.byref(ckernel.parallel(2)),
        -1,
    )
    ckernel.check(rc)
    j = [jax.dlpack.from_dlpack(t) for t in (tq, tkv, tidx, tsink, ttl)]
    got = jax.jit(lambda q, kv, i, s, t: dsv4_jax.sparse_attention(q, kv, i, 0.05, s, t, backend="cpu"))(*j)
    import dsv4_torch

    wrapped = dsv4_torch.sparse_attention(tq, tkv, tidx, 0.05, tsink, ttl, backend="cpu")  # torch's own entry point
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    for t_res, w_res, j_res in zip((out, ml, lse), wrapped, got):
        t_bits = t_res.view(bits if t_res.dtype == tdt else torch.int32).numpy()
        np.testing.assert_array_equal(t_bits, np.asarray(j_res).view(t_bits.dtype))
        np.testing.assert_array_equal(
            t_bits, w_res.contiguous().view(bits if w_res.dtype == tdt else torch.int32).numpy()
        )


# --- backend choice, bad inputs, no backward ------------------------------------------------


def test_resolution_on_the_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("the default device is not the CPU")
    assert dsv4_jax.available_backends()["cpu"] is None
    assert "cpu" in dsv4_jax.BACKENDS and "cpu" in dsv4_jax.backends.ATTENTION
    for dt in (jnp.bfloat16, jnp.float32):
        q = jnp.zeros((2, 16, 64), dt)
        assert dsv4_jax.resolve_backend("auto", q) == dsv4_jax.resolve_backend("cpu", q) == "cpu"
    q16 = jnp.zeros((2, 16, 64), jnp.float16)
    assert dsv4_jax.resolve_backend("auto", q16) == "xla"  # the kernel takes bf16 / float32 only
    with pytest.raises(TypeError, match=r"q: backend='cpu' takes bfloat16 / float32, got float16"):
        dsv4_jax.resolve_backend("cpu", q16)
    with pytest.raises(TypeError, match="float16"):
        dsv4_jax.sparse_attention(
            q16, jnp.zeros((4, 64), jnp.float16), jnp.zeros((2, 4), jnp.int32), 0.1, backend="cpu"
        )
    out = dsv4_jax.sparse_attention(q16, jnp.zeros((4, 64), jnp.float16), jnp.zeros((2, 4), jnp.int32), 0.1)
    assert out[0].dtype == jnp.float16  # "auto" ran xla


def test_unbuildable_kernel_is_reported(monkeypatch):
    """Where the library cannot be built: "auto" keeps xla, a named "cpu" raises with the reason."""
    monkeypatch.setattr(
        cpu_library, "_state", {"error": "RuntimeError: no C compiler found ('cc' is not on PATH; set CC)"}
    )
    q = jnp.zeros((2, 16, 64), jnp.float32)
    assert dsv4_jax.resolve_backend("auto", q) == "xla"
    assert "no C compiler" in dsv4_jax.available_backends()["cpu"]
    with pytest.raises(
        dsv4_jax.BackendUnavailableError, match=r"backend='cpu' cannot run here: RuntimeError: no C compiler"
    ):
        dsv4_jax.resolve_backend("cpu", q)
    with pytest.raises(dsv4_jax.BackendUnavailableError, match="no C compiler"):
        cpu_attention.sparse_attention(q, jnp.zeros((4, 64)), jnp.zeros((2, 4), jnp.int32), 0.1)


def test_unknown_isa_name_raises(monkeypatch):
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", "sse9")
    q, kv, idx, _, _ = _case(0, T=2, H=16, D=64, S=8, K=4, dtype="float32", lengths=False)
    with pytest.raises(jax.errors.JaxRuntimeError, match="DSV4_PREFILL_CPU_ISA: unknown instruction set 'sse9'"):
        _run(q, kv, idx, 0.1, None, None, "float32", jit=True)


def test_gradient_raises_instead_of_a_wrong_one():
    """An FFI call has no derivative rule: jax.grad through backend "cpu" raises, eagerly and
    under jit (the forward pass alone still runs)."""
    q, kv, idx, sink, tl = _case(5, T=3, H=16, D=64, S=20, K=8, dtype="float32")

    def loss(q, kv):
        out, _, lse = dsv4_jax.sparse_attention(
            q, kv, jnp.asarray(idx), 0.1, jnp.asarray(sink), jnp.asarray(tl), backend="cpu"
        )
        return out.sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    args = (jnp.asarray(q), jnp.asarray(kv))
    for f in (jax.grad(loss, argnums=(0, 1)), jax.jit(jax.grad(loss)), jax.value_and_grad(loss, argnums=1)):
        with pytest.raises(NotImplementedError, match=r"sparse_attention: backend='cpu' .* has no backward pass"):
            f(*args)
    assert np.isfinite(float(loss(*args)))
