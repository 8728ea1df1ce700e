"""dsv4_jax.kvcache_v41 against the NumPy reference (planner.kvcache_v41): the same bytes from every
writer, the same values from the gather (every record, both layouts, random pages with NaN codes
and extreme scale bytes), eager and under jit, every backend that runs here, bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import kvcache_v41 as JV
from planner import kvcache_v41 as V
from planner.contract import BackendUnavailableError
from tests import v41_record_cases as C

REC = V.RECORDS
NAMES = [*REC, "index_fp8_mx"]  # the last: FP8 index keys with UE8M0 scales (mx_scales=True)


def record(name):
    return (V.MX_INDEX_FP8, {"mx_scales": True}) if name == "index_fp8_mx" else (REC[name], {})


def gather_backends(name):
    out = ["xla"]
    if name == "mxfp8" and JV.resolve_backend("auto", jnp.zeros(1, jnp.uint8), op="gather_mxfp8") == "cpu":
        out.append("cpu")
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", V.LAYOUTS)
def test_insert_records_bytes_equal_numpys(name, layout):
    rng = np.random.default_rng(hash((name, layout)) % 1000)
    (r, mx), S, nb, T = record(name), 8, 5, 30
    x = C.rows(rng, T, r.dims, as_bf16=False)
    slots = C.slot_mapping(rng, T - 3, nb * S)
    start = np.ascontiguousarray(C.random_pages(rng, nb, S, r))
    want = start.copy()
    V.insert_records(x, want, slots, layout=layout, **mx)
    got = JV.insert_records(x, jnp.asarray(start), slots, layout=layout, **mx)
    assert np.array_equal(np.asarray(got), want)
    # 2-D pages with a padded stride
    flat = np.concatenate([start.reshape(nb, -1), np.full((nb, 40), 9, np.uint8)], axis=1)
    got = JV.insert_records(
        jnp.asarray(x), jnp.asarray(flat), jnp.asarray(slots), S, bytes_per_token=r.bytes, layout=layout, **mx
    )
    got = np.asarray(got)
    assert np.array_equal(got[:, : S * r.bytes].reshape(want.shape), want) and (got[:, S * r.bytes :] == 9).all()


@pytest.mark.parametrize("width", [528, 288])
def test_kv_writers_bytes_equal_numpys(width):
    rng = np.random.default_rng(width)
    S, nb, T = 4, 6, 23
    lat = C.rows(rng, T, 512)
    pos, cs = C.rope_case(rng, T, 2)
    slots = C.slot_mapping(rng, T, nb * S)
    lat_j = jnp.asarray(lat, jnp.bfloat16)
    for ratio in (1, 2):
        for layout in V.LAYOUTS:
            want = np.zeros((nb, S, width), np.uint8)
            V.rope_quant_insert(lat, pos, cs, want, slots, ratio, layout=layout)
            got = JV.rope_quant_insert(
                lat_j, pos, cs, jnp.zeros((nb, S, width), jnp.uint8), slots, ratio, layout=layout
            )
            assert np.array_equal(np.asarray(got), want), (ratio, layout)
    jitted = jax.jit(functools.partial(JV.rope_quant_insert, compress_ratio=2))
    got = jitted(lat_j, jnp.asarray(pos), jnp.asarray(cs), jnp.zeros((nb, S, width), jnp.uint8), jnp.asarray(slots))
    want = np.zeros((nb, S, width), np.uint8)
    V.rope_quant_insert(lat, pos, cs, want, slots, 2)
    assert np.array_equal(np.asarray(got), want)
    want = np.zeros((nb, S, width), np.uint8)
    V.quantize_and_insert_k_cache(lat, want, slots)
    got = JV.quantize_and_insert_k_cache(lat_j, jnp.zeros((nb, S, width), jnp.uint8), slots)
    assert np.array_equal(np.asarray(got), want)


@pytest.mark.parametrize("fp4, mx", [(False, False), (True, False), (False, True)])
def test_index_writer_bytes_equal_numpys(fp4, mx):
    rng = np.random.default_rng(7 + fp4)
    S, nb, T, width = 8, 4, 29, 68 if fp4 else 132
    k_pre = C.bf16(rng.standard_normal((T, 128)) * 10.0 ** rng.integers(-8, 8, (T, 1)))
    w = C.bf16(rng.standard_normal(128))
    pos, cs = C.rope_case(rng, T, 1)
    slots = C.slot_mapping(rng, T, nb * S)
    for ratio, cs_j in ((1, jnp.asarray(cs)), (2, jnp.asarray(cs, jnp.bfloat16))):
        want = np.zeros((nb, S, width), np.uint8)
        V.indexer_k_norm_rope_store(
            k_pre, pos, np.asarray(cs_j, np.float32), w, 1e-6, want, slots, ratio, fp4, mx_scales=mx
        )
        got = JV.indexer_k_norm_rope_store(
            jnp.asarray(k_pre, jnp.bfloat16),
            pos,
            cs_j,
            jnp.asarray(w),
            1e-6,
            jnp.zeros((nb, S, width), jnp.uint8),
            slots,
            ratio,
            fp4,
            mx_scales=mx,
        )
        assert np.array_equal(np.asarray(got), want), ratio


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", V.LAYOUTS)
def test_gather_values_equal_numpys(name, layout):
    rng = np.random.default_rng(hash((name, layout, 1)) % 1000)
    (r, mx), S, nb = record(name), 4, 6
    pages = np.ascontiguousarray(C.random_pages(rng, nb, S, r))
    if r.name == "mxfp8":
        pages[:, :, -16:] = rng.choice([0, 1, 105, 127, 200, 247, 254, 255], (nb, S, 16))
    if r.name == "index_fp8":  # scales whose products stay normal floats (XLA on CPU flushes subnormals)
        sc = (rng.random((nb, S)) * 2.0 ** rng.integers(-30, 100, (nb, S))).astype(np.float32)
        sc.reshape(-1)[:3] = [0.0, np.inf, np.nan]
        for b in range(nb):
            for p in range(S):
                o = p * 132 + 128 if layout == "interleaved" else S * 128 + p * 4
                pages.reshape(nb, -1)[b, o : o + 4] = sc[b, p : p + 1].view(np.uint8)
    seq, glen, bt, rows, off = C.gather_case(rng, nb, S)
    want = np.full((4, rows, r.dims), 7.0, np.float32)
    V.dequantize_and_gather_k_cache(want, pages, seq, glen, bt, offset=off, layout=layout, **mx)
    for backend in gather_backends(name):
        for dtype in (jnp.float32, jnp.bfloat16):
            out = jnp.full((4, rows, r.dims), 7.0, dtype)
            got = JV.dequantize_and_gather_k_cache(
                out, jnp.asarray(pages), seq, glen, bt, offset=off, layout=layout, backend=backend, **mx
            )
            w = want if dtype == jnp.float32 else C.bf16(want)
            assert np.array_equal(np.asarray(got, np.float32), w, equal_nan=True), (backend, dtype)
    fn = jax.jit(functools.partial(JV.dequantize_and_gather_k_cache, offset=off, layout=layout, backend="xla", **mx))
    got = fn(jnp.full((4, rows, r.dims), 7.0), jnp.asarray(pages), jnp.asarray(seq), jnp.asarray(glen), jnp.asarray(bt))
    assert np.array_equal(np.asarray(got), want, equal_nan=True)


def test_named_backends():
    pages = jnp.zeros((1, 4, 288), jnp.uint8)
    assert JV.resolve_backend("auto", pages, op="gather_records") == "xla"
    with pytest.raises(BackendUnavailableError, match="backend='cpu' cannot run here: it has no 'insert_records'"):
        JV.insert_records(jnp.zeros((1, 512)), pages, jnp.array([0]), backend="cpu")


Z = jnp.zeros
U8 = jnp.uint8
BAD = [
    (lambda: JV.insert_records(Z((1, 512)), Z((1, 4, 528), U8), [0]), "slot_mapping: expected a jax.Array"),
    (lambda: JV.insert_records(Z((1, 512)), Z((1, 4, 530), U8), jnp.array([0])), "k_cache: the last dim 530"),
    (lambda: JV.insert_records(Z((1, 512)), Z((1, 4, 528)), jnp.array([0])), "k_cache: expected uint8"),
    (lambda: JV.insert_records(Z((1, 512), jnp.bfloat16), Z((1, 4, 528), U8), jnp.array([0])), "x: expected float32"),
    (
        lambda: JV.insert_records(Z((1, 512)), Z((1, 4, 528), U8), jnp.array([4])),
        r"slot_mapping: slot_mapping\[0\] = 4",
    ),
    (lambda: JV.insert_records(jnp.full((1, 512), jnp.nan), Z((1, 4, 528), U8), jnp.array([0])), "x: must be finite"),
    (
        lambda: JV.quantize_and_insert_k_cache(Z((1, 512), jnp.bfloat16), Z((1, 4 * 528), U8), jnp.array([0])),
        "k_cache: 2-D pages",
    ),
    (
        lambda: JV.rope_quant_insert(
            Z((1, 512), jnp.bfloat16), jnp.array([3]), Z((2, 64)), Z((1, 4, 528), U8), jnp.array([0]), 1
        ),
        r"positions: positions\[0\] = 3",
    ),
    (
        lambda: JV.rope_quant_insert(
            Z((1, 512), jnp.bfloat16), jnp.array([3]), Z((8, 64)), Z((1, 4, 528), U8), jnp.array([0]), 3
        ),
        "compress_ratio: V4.1",
    ),
    (
        lambda: JV.indexer_k_norm_rope_store(
            Z((1, 128), jnp.bfloat16),
            jnp.array([0]),
            Z((8, 64)),
            Z(128),
            1e-6,
            Z((1, 4, 132), U8),
            jnp.array([0]),
            1,
            True,
        ),
        "k_cache: holds index_fp8",
    ),
    (
        lambda: JV.dequantize_and_gather_k_cache(
            Z((1, 4, 128)), Z((1, 4, 528), U8), jnp.array([4]), None, jnp.array([[0]])
        ),
        r"out: expected shape \[R, rows, 512\]",
    ),
    (
        lambda: JV.dequantize_and_gather_k_cache(
            Z((1, 4, 512)), Z((1, 4, 528), U8), jnp.array([4]), None, jnp.array([[3]])
        ),
        r"block_table: entry \[0, 0\] = 3",
    ),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_inputs_are_named(i):
    call, match = BAD[i]
    with pytest.raises((ValueError, TypeError), match=match):
        call()
