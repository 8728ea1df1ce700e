"""planner.kvcache_v41, DeepSeek-V4.1's cache records in NumPy, checked against the format itself:
byte positions in both layouts, hand-built records decoded, every quantization rule at its edges,
round trips within half a step, vLLM's gather addressing, and every bad input by name."""

import ml_dtypes
import numpy as np
import pytest

from planner import kvcache_v41 as V
from tests import v41_record_cases as C

REC = V.RECORDS
MX = V.MX_INDEX_FP8


def test_mx_index_keys_hold_the_fp8_keys_scale_as_four_ue8m0_bytes():
    """mx_scales=True (vLLM on SM100): the same e4m3 bytes as index_fp8, the scale 2^e as four bytes
    e + 127, and the same values back; one byte per 32 dims on read."""
    rng = np.random.default_rng(9)
    x = C.rows(rng, 12, 128)
    a, b = np.zeros((2, 8, 132), np.uint8), np.zeros((2, 8, 132), np.uint8)
    V.insert_records(x, a, np.arange(12))
    V.insert_records(x, b, np.arange(12), mx_scales=True)
    fa, fb = a.reshape(2, -1), b.reshape(2, -1)
    assert np.array_equal(fa[:, :1024], fb[:, :1024])
    e = (fa[:, 1024:].view("<f4").view(np.uint32) >> 23).astype(np.uint8)  # the float32 2^e's exponent
    assert np.array_equal(fb[:, 1024:].reshape(2, 8, 4), np.repeat(e[..., None], 4, axis=-1))
    want, got = np.zeros((1, 16, 128), np.float32), np.zeros((1, 16, 128), np.float32)
    V.dequantize_and_gather_k_cache(want, a, [12], None, [[0, 1]])
    V.dequantize_and_gather_k_cache(got, b, [12], None, [[0, 1]], mx_scales=True)
    assert np.array_equal(got, want)
    y = V.decode(np.full((1, 128), 0x38, np.uint8), np.array([[120, 127, 128, 135]], np.uint8), MX)
    assert y[0, ::32].tolist() == [2.0**-7, 1.0, 2.0, 2.0**8]
    with pytest.raises(ValueError, match="mx_scales: only FP8 index keys"):
        V.insert_records(np.zeros((1, 128), np.float32), np.zeros((1, 4, 68), np.uint8), [0], mx_scales=True)


def test_record_sizes_and_default_layouts():
    assert {r.name: r.bytes for r in REC.values()} == {"mxfp8": 528, "nvfp4": 288, "index_fp8": 132, "index_mxfp4": 68}
    assert [V.default_layout(n) for n in REC] == ["interleaved", "interleaved", "split", "split"]


@pytest.mark.parametrize("name", list(REC))
def test_layouts_place_a_slots_bytes(name):
    r, S, nb = REC[name], 4, 2
    x = C.rows(np.random.default_rng(1), 1, r.dims) + 1.0
    data, scales = V.encode(x, r)
    for layout in V.LAYOUTS:
        pages = np.zeros((nb, S, r.bytes), np.uint8)
        V.insert_records(x, pages, np.array([S + 2]), layout=layout)  # page 1, slot 2
        assert not pages[0].any()
        flat = pages[1].reshape(-1)
        if layout == "interleaved":
            d0, s0 = 2 * r.bytes, 2 * r.bytes + r.data_bytes
        else:
            d0, s0 = 2 * r.data_bytes, S * r.data_bytes + 2 * r.scale_bytes
        assert np.array_equal(flat[d0 : d0 + r.data_bytes], data[0])
        assert np.array_equal(flat[s0 : s0 + r.scale_bytes], scales[0])
        rest = np.ones(flat.shape, bool)
        rest[d0 : d0 + r.data_bytes] = rest[s0 : s0 + r.scale_bytes] = False
        assert not flat[rest].any()


def test_hand_built_records_decode():
    # mxfp8: e4m3 0x38 = 1.0, 0xC4 = -3.0 (sign, exponent 8, mantissa 4/8) with byte 130 = 2^3
    data = np.zeros((1, 512), np.uint8)
    data[0, 0], data[0, 1], data[0, 32] = 0x38, 0xC4, 0x38
    sc = np.full((1, 16), 127, np.uint8)
    sc[0, 0] = 130
    y = V.decode(data, sc, REC["mxfp8"])
    assert y[0, 0] == 8.0 and y[0, 1] == -24.0 and y[0, 32] == 1.0 and not y[0, 2:32].any()
    # nvfp4: byte 0x21 = element 0 code 1 (0.5, low nibble), element 1 code 2 (1.0); scale e4m3 0x40 = 2.0
    d4 = np.zeros((1, 256), np.uint8)
    d4[0, 0], d4[0, 8] = 0x21, 0xF7  # element 16: 6.0, element 17: -6.0
    s4 = np.full((1, 32), 0x38, np.uint8)
    s4[0, 0] = 0x40
    y = V.decode(d4, s4, REC["nvfp4"])
    assert y[0, :2].tolist() == [1.0, 2.0] and y[0, 16:18].tolist() == [6.0, -6.0]
    # index_fp8: one little-endian float32 scale
    y = V.decode(np.full((1, 128), 0x38, np.uint8), np.float32(0.25).reshape(1).view(np.uint8)[None], REC["index_fp8"])
    assert (y == 0.25).all()
    # index_mxfp4: UE8M0 per 32 dims
    y = V.decode(np.full((1, 64), 0x76, np.uint8), np.array([[126, 127, 128, 129]], np.uint8), REC["index_mxfp4"])
    assert y[0, 0:2].tolist() == [4.0 * 0.5, 6.0 * 0.5] and y[0, 96:98].tolist() == [16.0, 24.0]


def test_mxfp8_exponent_rule():
    x = np.zeros((4, 512), np.float32)
    x[0, :32] = 448.0  # exactly 448 * 2^0: byte 127, e4m3 448 (0x7E)
    x[1, :32] = 449.0  # just above: 2^1
    x[2, 5] = -3.0  # one value: 2^ceil(log2(3/448)) = 2^-7
    data, sc = V.encode(x, REC["mxfp8"])
    assert sc[0, 0] == 127 and data[0, 0] == 0x7E
    assert sc[1, 0] == 128
    assert sc[2, 0] == 120 and data[2, 5] == 0xFC  # -3 * 2^7 = -384 = -1.5 * 2^8: 0xFC
    assert (sc[3] == 127 - 22).all()  # all zero: the 1e-4 floor, ceil(log2(1e-4 / 448)) = -22
    assert (sc[0, 1:] == 105).all()


def test_nvfp4_scale_and_ties():
    x = np.zeros((3, 512), np.float32)
    x[0, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    x[1, :16] = 6.6  # amax / 6 = 1.1 -> e4m3 1.125 (0x39); 6.6 / 1.125 = 5.87 -> 6
    x[2, :16] = 1e6  # clamped to 448 (0x7E)
    data, sc = V.encode(x, REC["nvfp4"])
    assert sc[0, 0] == 0x38 and sc[0, 1] == 0x01  # scale 1.0; an all-zero group: 2^-9
    codes = np.stack([data[0, :8] & 0xF, data[0, :8] >> 4], axis=1).reshape(-1)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]  # ties to even codes
    assert sc[1, 0] == 0x39 and (data[1, :8] == 0x77).all()
    assert sc[2, 0] == 0x7E and (data[2, :8] == 0x77).all()  # 1e6 / 448 saturates at 6


def test_e2m1_rounding_equals_ml_dtypes():
    x = np.random.default_rng(0).standard_normal(20000).astype(np.float32) * 4
    x[:40] = np.repeat([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -0.0, -0.1], 4)
    want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    assert np.array_equal(V.e2m1_codes(x), want)


def test_mxfp4_index_rule():
    x = np.zeros((2, 128), np.float32)
    x[0, :32] = 6.0  # 2^0
    x[0, 32] = 6.5  # 2^1: 6.5 / 2 = 3.25 -> 3
    data, sc = V.encode(x, REC["index_mxfp4"])
    assert sc[0, :2].tolist() == [127, 128] and data[0, 0] == 0x77 and data[0, 16] & 0xF == 5
    floor = int(V.ceil_log2(V.MXFP4_AMAX_FLOOR * V.INV_FP4_MAX)) + 127
    assert floor in (1, 2) and (sc[1] == floor).all()


@pytest.mark.parametrize("name", list(REC))
def test_round_trip_within_half_a_step(name):
    r = REC[name]
    x = C.rows(np.random.default_rng(2), 64, r.dims, as_bf16=False)
    if name == "nvfp4":  # its scale saturates at 448 (amax 2688) and bottoms at 2^-9
        x = np.clip(x, -2000, 2000)
    y = V.decode(*V.encode(x, r), r)
    g = x.reshape(64, -1, r.group)
    amax = np.abs(g).max(-1, keepdims=True)
    if name in ("mxfp8", "index_fp8"):
        amax = np.maximum(amax, np.float32(1e-4))  # half an e4m3 ulp; subnormals: 2^-10 of the scale < amax / 448
        tol = np.abs(g) * 2.0**-4 + amax / 448 * 2.0**-9
    elif name == "nvfp4":  # half of e2m1's widest gap (1) times the scale; past 6 * scale, saturated
        sc = V.encode(x, r)[1].view(ml_dtypes.float8_e4m3fn).astype(np.float32)[..., None]
        assert (sc >= np.minimum(amax / 6 * (1 - 2.0**-4), 2.0**-9)).all()  # amax / 6 to nearest e4m3
        tol = np.maximum(sc, np.abs(g) - 6 * sc)
    else:  # scale 2^e < amax / 3
        tol = np.maximum(amax, V.MXFP4_AMAX_FLOOR) / 3
    if r.main:
        tol = tol + np.abs(g) * 2.0**-8  # and the bf16 rounding
    err = np.abs(y.reshape(g.shape) - g)
    assert (err <= tol).all()


def test_writers_equal_insert_of_their_rows():
    rng = np.random.default_rng(3)
    T, S, nb = 9, 4, 3
    lat = C.rows(rng, T, 512)
    pos, cs = C.rope_case(rng, T, 2)
    slots = C.slot_mapping(rng, T, nb * S)
    for width in (528, 288):
        a = np.zeros((nb, S, width), np.uint8)
        V.rope_quant_insert(lat, pos, cs, a, slots, 2)
        b = np.zeros_like(a)
        keep = (slots >= 0) & ((pos + 1) % 2 == 0)
        c = cs[(pos // 2) * 2]
        V.insert_records(V.rope(lat, c[:, :32], c[:, 32:]), b, np.where(keep, slots, -1))
        assert np.array_equal(a, b)
        assert not np.array_equal(a, np.zeros_like(a))
        plain, b = np.zeros_like(a), np.zeros_like(a)
        V.quantize_and_insert_k_cache(lat, plain, slots)
        V.insert_records(lat, b, slots)
        assert np.array_equal(plain, b)


def test_rope_rotates_the_last_64_dims_as_gptj_pairs():
    x = np.zeros((1, 512), np.float32)
    x[0, 448], x[0, 449], x[0, 0] = 1.0, 2.0, 5.0
    c, s = np.zeros((1, 32), np.float32), np.zeros((1, 32), np.float32)
    s[0, 0] = 1.0  # a quarter turn: (e, o) -> (-o, e)
    y = V.rope(x, c + 0, s)
    assert y[0, 448] == -2.0 and y[0, 449] == 1.0 and y[0, 0] == 5.0


def test_index_writer_norm_rope_quant():
    rng = np.random.default_rng(4)
    T, S, nb = 7, 4, 2
    k_pre = C.bf16(rng.standard_normal((T, 128)) * 10.0 ** rng.integers(-3, 4, (T, 1)))
    w = C.bf16(rng.standard_normal(128))
    pos, cs = C.rope_case(rng, T, 1)
    slots = C.slot_mapping(rng, T, nb * S)
    for fp4, width in ((False, 132), (True, 68)):
        a = np.zeros((nb, S, width), np.uint8)
        V.indexer_k_norm_rope_store(k_pre, pos, cs, w, 1e-6, a, slots, 1, fp4)
        keys = V.bf16(V.rope(V.rms_norm(k_pre, w, np.float32(1e-6)), cs[pos, :32], cs[pos, 32:]))
        b = np.zeros_like(a)
        V.insert_records(keys, b, slots)
        assert np.array_equal(a, b)
    # the norm itself: x * (1 / sqrt(mean(x^2) + eps)) * w in float64, to float32 rounding
    want = k_pre / np.sqrt((k_pre.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * w
    assert np.allclose(V.rms_norm(k_pre, w, np.float32(1e-6)), want, rtol=2**-7)


@pytest.mark.parametrize("name", list(REC))
@pytest.mark.parametrize("layout", V.LAYOUTS)
def test_gather_reads_what_slots_hold(name, layout):
    rng = np.random.default_rng(5)
    r, S, nb = REC[name], 4, 5
    pages = C.random_pages(rng, nb, S, r, pad=16)  # random bytes, padded page stride
    seq, glen, bt, rows, off = C.gather_case(rng, nb, S)
    out = np.full((4, rows, r.dims), 7.0, np.float32)
    V.dequantize_and_gather_k_cache(out, pages, seq, glen, bt, offset=off, layout=layout)
    geo = V.page_geometry(pages.shape, pages.strides)
    for b in range(3):
        p = np.arange(seq[b] - glen[b], seq[b])
        data, sc = V.read_slots(pages, geo, layout, bt[b, p // S], p % S)
        want = V.decode(data, sc, r)
        assert np.array_equal(out[b, off : off + glen[b]], want, equal_nan=True)
        assert (out[b, :off] == 7.0).all() and (out[b, off + glen[b] :] == 7.0).all()
    assert (out[3] == 7.0).all()


def test_two_d_pages_with_a_padded_stride():
    rng = np.random.default_rng(6)
    S, nb = 2, 3
    x = C.rows(rng, 6, 512)
    view = np.zeros((nb, S, 528), np.uint8)
    V.insert_records(x, view, np.arange(6))
    flat = np.zeros((nb, S * 528 + 100), np.uint8)
    V.insert_records(x, flat, np.arange(6), 2, bytes_per_token=528)
    assert np.array_equal(flat[:, : S * 528].reshape(nb, S, 528), view) and not flat[:, S * 528 :].any()


BAD = [
    (
        lambda: V.insert_records(np.zeros((1, 512), np.float32), np.zeros((1, 4, 584), np.uint8), [0]),
        "k_cache: the last dim 584",
    ),
    (
        lambda: V.insert_records(np.zeros((1, 512), np.float32), np.zeros((1, 2112), np.uint8), [0]),
        "k_cache: 2-D pages",
    ),
    (
        lambda: V.insert_records(
            np.zeros((1, 512), np.float32), np.zeros((1, 100), np.uint8), [0], 4, bytes_per_token=528
        ),
        "k_cache: page stride 100",
    ),
    (
        lambda: V.insert_records(np.zeros((1, 512), np.float32), np.zeros((1, 4, 528), np.uint8), [0], 8),
        "block_size: 8",
    ),
    (
        lambda: V.insert_records(
            np.zeros((1, 512), np.float32), np.zeros((1, 4, 528), np.uint8), [0], bytes_per_token=288
        ),
        "bytes_per_token: 288",
    ),
    (
        lambda: V.insert_records(np.zeros((1, 512), np.float32), np.zeros((1, 4, 528), np.float32), [0]),
        "k_cache: expected uint8",
    ),
    (
        lambda: V.insert_records(np.zeros((1, 128), np.float32), np.zeros((1, 4, 528), np.uint8), [0]),
        r"x: expected shape \[T, 512\]",
    ),
    (
        lambda: V.insert_records(np.zeros((1, 512), np.float64), np.zeros((1, 4, 528), np.uint8), [0]),
        "x: expected float32",
    ),
    (
        lambda: V.insert_records(np.full((1, 512), np.inf, np.float32), np.zeros((1, 4, 528), np.uint8), [0]),
        r"x: must be finite, got x\[0, 0\] = inf",
    ),
    (
        lambda: V.insert_records(np.zeros((2, 512), np.float32), np.zeros((1, 4, 528), np.uint8), [0, 4]),
        r"slot_mapping: slot_mapping\[1\] = 4",
    ),
    (
        lambda: V.insert_records(np.zeros((2, 512), np.float32), np.zeros((1, 4, 528), np.uint8), [1, 1]),
        "slot_mapping: slot 1 appears more",
    ),
    (
        lambda: V.insert_records(np.zeros((1, 512), np.float32), np.zeros((1, 4, 528), np.uint8), [0], layout="rows"),
        "layout: expected one of",
    ),
    (
        lambda: V.quantize_and_insert_k_cache(np.full((1, 512), 0.1, np.float32), np.zeros((1, 4, 528), np.uint8), [0]),
        "k: must hold bf16 values",
    ),
    (
        lambda: V.quantize_and_insert_k_cache(np.zeros((1, 128), np.float32), np.zeros((1, 4, 132), np.uint8), [0]),
        "k_cache: holds index_fp8",
    ),
    (
        lambda: V.rope_quant_insert(
            np.zeros((1, 512), np.float32), [1], np.zeros((4, 64), np.float32), np.zeros((1, 4, 528), np.uint8), [0], 4
        ),
        "compress_ratio: V4.1",
    ),
    (
        lambda: V.rope_quant_insert(
            np.zeros((1, 512), np.float32), [9], np.zeros((4, 64), np.float32), np.zeros((1, 4, 528), np.uint8), [0], 1
        ),
        r"positions: positions\[0\] = 9 has no row",
    ),
    (
        lambda: V.rope_quant_insert(
            np.zeros((1, 512), np.float32), [1], np.zeros((4, 32), np.float32), np.zeros((1, 4, 528), np.uint8), [0], 1
        ),
        "cos_sin_cache: expected shape",
    ),
    (
        lambda: V.indexer_k_norm_rope_store(
            np.zeros((1, 128), np.float32),
            [0],
            np.zeros((4, 64), np.float32),
            np.ones(128, np.float32),
            1e-6,
            np.zeros((1, 4, 132), np.uint8),
            [0],
            1,
            True,
        ),
        "k_cache: holds index_fp8 records",
    ),
    (
        lambda: V.indexer_k_norm_rope_store(
            np.zeros((1, 128), np.float32),
            [0],
            np.zeros((4, 64), np.float32),
            np.ones(128, np.float32),
            -1.0,
            np.zeros((1, 4, 132), np.uint8),
            [0],
            1,
            False,
        ),
        "rms_norm_eps: expected a finite",
    ),
    (
        lambda: V.dequantize_and_gather_k_cache(
            np.zeros((1, 4, 512), np.float32), np.zeros((1, 4, 132), np.uint8), [4], None, [[0]]
        ),
        r"out: expected shape \[R, rows, 128\]",
    ),
    (
        lambda: V.dequantize_and_gather_k_cache(
            np.zeros((1, 8, 512), np.float32), np.zeros((1, 4, 528), np.uint8), [5], None, [[0]]
        ),
        "block_table: seq_lens",
    ),
    (
        lambda: V.dequantize_and_gather_k_cache(
            np.zeros((1, 4, 512), np.float32), np.zeros((1, 4, 528), np.uint8), [4], None, [[1]]
        ),
        r"block_table: entry \[0, 0\] = 1",
    ),
    (
        lambda: V.dequantize_and_gather_k_cache(
            np.zeros((1, 4, 512), np.float32), np.zeros((1, 4, 528), np.uint8), [4], [5], [[0]]
        ),
        "gather_lens: must lie",
    ),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_inputs_are_named(i):
    call, match = BAD[i]
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_index_fp8_split_pages_are_v4_index_key_pages():
    """V4.1's FP8 index keys in the split layout are byte for byte V4's indexer key pages
    (planner.index_cache: D e4m3 per slot, then a float32 scale per slot), so every V4 reader of
    those pages (the fused CPU indexer's DSV4_KV_INDEX_FP8 source among them) reads them as they are."""
    from planner import index_cache as IC

    rng = np.random.default_rng(8)
    S, nb, T = 8, 3, 20
    k = C.rows(rng, T, 128)
    slots = C.slot_mapping(rng, T, nb * S)
    v41 = np.zeros((nb, S, 132), np.uint8)
    V.insert_records(k, v41, slots)  # default layout of index_fp8: split
    v4 = np.zeros_like(v41)
    IC.indexer_k_quant_and_cache(k, v4, slots, 128)
    assert np.array_equal(v41, v4)
    got = IC.gather_index_keys(v41, np.arange(nb)[None], [nb * S])[0]
    want = np.zeros((1, nb * S, 128), np.float32)
    V.dequantize_and_gather_k_cache(want, v41, [nb * S], None, np.arange(nb)[None], offset=0)
    assert np.array_equal(got, want[0], equal_nan=True)
