"""dsv4_jax.kvcache against the NumPy reference (planner.kvcache), and torch == JAX == NumPy.

The xla path and the Pallas kernels (interpret mode here; Triton on NVIDIA GPUs, checked by
bench/checks/gpu_kvcache.py) write the reference's bytes and gather its values exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4_jax import kvcache as JK
from dsv4_jax.kernels.triton import kvcache as pallas_kvcache
from dsv4_jax.kernels.xla import kvcache as xla_kvcache
from planner import kvcache as P


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def tokens(rng, T):
    k = rng.standard_normal((T, 512)) * rng.choice([1e-3, 1.0, 50.0, 1e5], (T, 1))
    k[0, :448] = 0.0  # amax floor
    k[1, :64] = 448.0  # saturation point
    k[2, :448] = 3.3895313892515355e38  # bf16 max: scale byte 247
    k[3, :448] = 1e-30  # tiny
    return bf16(k)


def as_np(x):
    return np.asarray(jnp.asarray(x, jnp.float32) if x.dtype == jnp.bfloat16 else x)


# Shapes shared by the tests below, so each jitted function compiles once per (backend, S).
NB, T = 5, 24


@pytest.mark.parametrize("backend, S", [("xla", 64), ("xla", 2), ("triton:interpret", 16)])
def test_insert_bytes_equal_reference(backend, S):
    rng = np.random.default_rng(S)
    nb = NB
    k = tokens(rng, T)
    slots = rng.permutation(nb * S)[:T].astype(np.int64)
    slots[::4] = -1
    cache = rng.integers(0, 256, (nb, P.page_bytes(S)), dtype=np.uint8)
    want = cache.copy()
    P.quantize_and_insert_k_cache(k, want, slots, S)
    got = JK.quantize_and_insert_k_cache(
        jnp.asarray(k, jnp.bfloat16), jnp.asarray(cache), jnp.asarray(slots), S, **_kw(backend)
    )
    assert got.dtype == jnp.uint8 and np.array_equal(np.asarray(got), want)


def _kw(spec: str) -> dict:
    """backend= / interpret= of a test's backend spec ("xla", "triton:interpret")."""
    name, _, mode = spec.partition(":")
    return dict(backend=name, interpret=mode == "interpret")


def _need(backend):
    if backend == "cpu":
        from dsv4_jax.kernels.cpu import library as cpu_kvcache

        if (reason := cpu_kvcache.unavailable_reason()) is not None:
            pytest.skip(f"the cpu backend's FFI kernel cannot be built here: {reason}")


@pytest.mark.parametrize(
    "backend, S, offset", [("xla", 64, 3), ("triton:interpret", 2, 0), ("cpu", 64, 3), ("cpu", 2, 0)]
)
def test_gather_equals_reference_on_any_bytes(backend, S, offset):
    """Random page bytes: every e4m3 code (NaN, subnormal) and scale byte 0..255; shuffled block
    tables. (Offset 0 with fewer rows than a kernel block: masked lanes must not clobber row 0.)"""
    _need(backend)
    rng = np.random.default_rng(20 + S)
    nb = NB
    cache = rng.integers(0, 256, (nb, P.page_bytes(S)), dtype=np.uint8)
    seq = np.array([nb * S, 3, 2 * S + 1], np.int32)
    gl = np.array([nb * S - 1, 0, S], np.int32)
    bt = np.stack([rng.permutation(nb) for _ in range(3)]).astype(np.int32)
    rows = nb * S + 2
    want = np.full((4, rows, 512), 9.0, np.float32)
    P.dequantize_and_gather_k_cache(want, cache, seq, gl, bt, S, offset)
    got = JK.dequantize_and_gather_k_cache(
        jnp.full((4, rows, 512), 9.0, jnp.bfloat16),
        jnp.asarray(cache),
        jnp.asarray(seq),
        jnp.asarray(gl),
        jnp.asarray(bt),
        S,
        offset,
        **_kw(backend),
    )
    assert got.dtype == jnp.bfloat16 and np.array_equal(as_np(got), want, equal_nan=True)


def test_pallas_float_path_on_written_pages():
    """The GPU kernel's float32 decode (run interpreted) equals the reference on pages the writer
    produced (scale bytes 105..247: no subnormal products, which XLA on CPU would flush)."""
    rng = np.random.default_rng(7)
    S, nb = 16, 4
    k = tokens(rng, nb * S)
    cache = np.zeros((nb, P.page_bytes(S)), np.uint8)
    P.quantize_and_insert_k_cache(k, cache, np.arange(nb * S), S)
    want = np.zeros((1, nb * S, 512), np.float32)
    bt = rng.permutation(nb).astype(np.int32)[None]
    P.dequantize_and_gather_k_cache(want, cache, np.array([nb * S]), None, bt, S, 0)
    a = (jnp.zeros((1, nb * S, 512), jnp.bfloat16), jnp.asarray(cache), jnp.asarray([nb * S], jnp.int32))
    got = pallas_kvcache.gather_dequant(a[0], a[1], a[2], a[2], jnp.asarray(bt), S, 0, interpret=True, exact=False)
    assert np.array_equal(as_np(got), want, equal_nan=True)
    got = xla_kvcache.gather_dequant(a[0], a[1], a[2], a[2], jnp.asarray(bt), S, 0, exact=False)  # xla's fast branch
    assert np.array_equal(as_np(got), want, equal_nan=True)


def test_torch_jax_numpy_agree():
    torch = pytest.importorskip("torch")  # the jax >= 0.11 run (`make test-jax-new`) has no torch
    from dsv4_torch import kvcache as TK

    rng = np.random.default_rng(8)
    S, nb = 64, NB  # the shapes of the tests above: no new compilation
    k = tokens(rng, T)
    slots = rng.permutation(nb * S)[:T].astype(np.int64)
    slots[5] = -1
    start = rng.integers(0, 256, (nb, P.page_bytes(S)), dtype=np.uint8)
    ref = start.copy()
    P.quantize_and_insert_k_cache(k, ref, slots, S)
    tc = torch.from_numpy(start.copy())
    TK.quantize_and_insert_k_cache(torch.from_numpy(k).bfloat16(), tc, torch.from_numpy(slots), S)
    jc = JK.quantize_and_insert_k_cache(jnp.asarray(k, jnp.bfloat16), jnp.asarray(start), jnp.asarray(slots), S)
    assert np.array_equal(tc.numpy(), ref) and np.array_equal(np.asarray(jc), ref)
    seq = np.array([nb * S, 3, 2 * S + 1], np.int32)  # unwritten slots hold random bytes (NaN codes too)
    gl = np.array([nb * S - 1, 0, S], np.int32)
    bt = np.stack([rng.permutation(nb) for _ in range(3)]).astype(np.int32)
    shape = (4, nb * S + 2, 512)
    want = np.zeros(shape, np.float32)
    P.dequantize_and_gather_k_cache(want, ref, seq, gl, bt, S, 3)
    to = torch.zeros(shape, dtype=torch.bfloat16)
    TK.dequantize_and_gather_k_cache(to, tc, torch.from_numpy(seq), torch.from_numpy(gl), torch.from_numpy(bt), S, 3)
    jo = JK.dequantize_and_gather_k_cache(
        jnp.zeros(shape, jnp.bfloat16), jc, jnp.asarray(seq), jnp.asarray(gl), jnp.asarray(bt), S, 3
    )
    t_bits = to.view(torch.int16).numpy()
    j_bits = np.asarray(jax.lax.bitcast_convert_type(jo, jnp.int16))
    assert np.array_equal(t_bits, j_bits)  # bitwise, torch == JAX
    assert np.array_equal(to.float().numpy(), want, equal_nan=True)


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_under_jit_and_untrusted_values(backend):
    """Under jit: same bytes; a slot outside the pages is dropped, a page outside k_cache reads NaN."""
    _need(backend)
    S, nb = 2, 4
    rng = np.random.default_rng(9)
    k = jnp.asarray(tokens(rng, 6), jnp.bfloat16)
    cache = jnp.zeros((nb, P.page_bytes(S)), jnp.uint8)
    insert = jax.jit(functools.partial(JK.quantize_and_insert_k_cache, block_size=S, backend="xla"))
    slots = jnp.asarray([0, 1, 2, 99, -5, 7], jnp.int32)
    got = np.asarray(insert(k, cache, slots))
    want = np.zeros((nb, P.page_bytes(S)), np.uint8)
    P.quantize_and_insert_k_cache(np.asarray(k.astype(jnp.float32)), want, np.array([0, 1, 2, -1, -1, 7]), S)
    assert np.array_equal(got, want)
    gather = jax.jit(functools.partial(JK.dequantize_and_gather_k_cache, block_size=S, offset=1, backend=backend))
    out = gather(
        jnp.zeros((1, 5, 512), jnp.bfloat16),
        jnp.asarray(got),
        jnp.asarray([4], jnp.int32),
        None,
        jnp.asarray([[1, 50]], jnp.int32),
    )
    o = as_np(out)
    assert (o[0, 0] == 0).all() and np.isnan(o[0, 3:]).all()  # page 50 is not in k_cache
    ref = np.zeros((1, 5, 512), np.float32)
    P.dequantize_and_gather_k_cache(ref, want, np.array([2]), None, np.array([[1]]), S, 1)
    assert np.array_equal(o[0, 1:3], ref[0, 1:3])


def test_rejects():
    S = 16
    cache = jnp.zeros((3, P.page_bytes(S)), jnp.uint8)
    k = jnp.zeros((4, 512), jnp.bfloat16)
    slots = jnp.arange(4)
    with pytest.raises(TypeError, match="k_cache: expected uint8"):
        JK.quantize_and_insert_k_cache(k, cache.astype(jnp.int8), slots, S)
    with pytest.raises(ValueError, match="page stride 9800 bytes is not round_up"):
        JK.quantize_and_insert_k_cache(k, jnp.zeros((3, 9800), jnp.uint8), slots, S)
    with pytest.raises(TypeError, match="k: expected bfloat16"):
        JK.quantize_and_insert_k_cache(k.astype(jnp.float32), cache, slots, S)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 48"):
        JK.quantize_and_insert_k_cache(k, cache, jnp.asarray([0, 48]), S)
    with pytest.raises(ValueError, match="slot 2 appears more than once"):
        JK.quantize_and_insert_k_cache(k, cache, jnp.asarray([2, 2]), S)
    with pytest.raises(ValueError, match="k: must be finite"):
        JK.quantize_and_insert_k_cache(k.at[1, 3].set(jnp.inf), cache, slots, S)
    out = jnp.zeros((2, 8, 512), jnp.bfloat16)
    seq, bt = jnp.asarray([8, 4], jnp.int32), jnp.asarray([[0], [1]], jnp.int32)
    with pytest.raises(ValueError, match=r"gather_lens\[1\] = 5 with seq_lens\[1\] = 4"):
        JK.dequantize_and_gather_k_cache(out, cache, seq, jnp.asarray([8, 5], jnp.int32), bt, S, 0)
    with pytest.raises(ValueError, match=r"entry \[0, 0\] = 3 is not a page"):
        JK.dequantize_and_gather_k_cache(out, cache, seq, None, jnp.asarray([[3], [1]], jnp.int32), S, 0)
    with pytest.raises(ValueError, match="8 rows per request are too few for offset 2"):
        JK.dequantize_and_gather_k_cache(out, cache, seq, None, bt, S, 2)
    with pytest.raises(ValueError, match=r"block_table: seq_lens\[0\] = 20 needs 2 pages"):
        JK.dequantize_and_gather_k_cache(
            jnp.zeros((2, 20, 512), jnp.bfloat16), cache, jnp.asarray([20, 4], jnp.int32), None, bt, S, 0
        )
    with pytest.raises(TypeError, match="block_table: expected int32"):
        JK.dequantize_and_gather_k_cache(out, cache, seq, None, bt.astype(jnp.float32), S, 0)
    with pytest.raises(TypeError, match="offset: must be a Python int"):
        jax.jit(lambda o, off: JK.dequantize_and_gather_k_cache(o, cache, seq, None, bt, S, off))(out, 0)
    with pytest.raises(ValueError, match="backend"):
        JK.dequantize_and_gather_k_cache(out, cache, seq, None, bt, S, 0, backend="cuda")


def test_cpu_backend_is_auto_on_cpu_equals_xla_and_donates():
    """auto on CPU = the C kernel for gathers (xla for the writer); its bits equal the xla path's
    on written pages and on any bytes, traced lengths included; a donated out is reused."""
    _need("cpu")
    from planner.contract import BackendUnavailableError

    S, nb = 16, 6
    cache = jnp.zeros((nb, P.page_bytes(S)), jnp.uint8)
    assert JK.resolve_backend("auto", cache) == "cpu"
    assert JK.resolve_backend("auto", cache, op="insert") == "xla"
    with pytest.raises(BackendUnavailableError, match="gather only"):
        JK.quantize_and_insert_k_cache(jnp.zeros((1, 512), jnp.bfloat16), cache, jnp.asarray([0]), S, backend="cpu")
    with pytest.raises(ValueError, match="op"):
        JK.resolve_backend("auto", cache, op="write")
    rng = np.random.default_rng(31)
    written = JK.quantize_and_insert_k_cache(
        jnp.asarray(tokens(rng, nb * S), jnp.bfloat16), cache, jnp.arange(nb * S), S
    )
    random = jnp.asarray(rng.integers(0, 256, (nb, P.page_bytes(S)), dtype=np.uint8))
    seq, gl = jnp.asarray([nb * S, 7, 3 * S], jnp.int32), jnp.asarray([nb * S - 2, 7, S + 3], jnp.int32)
    bt = jnp.asarray(np.stack([rng.permutation(nb) for _ in range(3)]).astype(np.int32))
    shape = (3, nb * S + 1, 512)
    for pages in (written, random):
        outs = {}
        for backend in ("xla", "cpu"):
            f = jax.jit(
                lambda o, c, s, g, b, backend=backend: JK.dequantize_and_gather_k_cache(
                    o, c, s, g, b, S, 1, backend=backend
                ),
                donate_argnums=0,
            )
            outs[backend] = f(jnp.full(shape, 5.0, jnp.bfloat16), pages, seq, gl, bt)
        a, b = (np.asarray(jax.lax.bitcast_convert_type(outs[k], jnp.uint16)) for k in ("xla", "cpu"))
        nan = np.isnan(as_np(outs["xla"]))
        assert np.array_equal(a[~nan], b[~nan]) and np.array_equal(nan, np.isnan(as_np(outs["cpu"])))
