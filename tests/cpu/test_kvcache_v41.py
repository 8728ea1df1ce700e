"""The C decoder and gather of DeepSeek-V4.1's 528-byte mxfp8 records (dsv4_cpu/csrc/kvcache_v41.c,
gather_v41.cc) through the ctypes binding on NumPy arrays: every (e4m3 byte, scale byte) pair
against the NumPy reference, the gather against planner.kvcache_v41 in both layouts with
threads, and argument errors by name."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from dsv4_cpu import binding as C
from planner import kvcache_v41 as V

LIB = C.library()
REC = V.RECORDS["mxfp8"]


def test_decode_every_code_and_scale_byte():
    """All 256 x 256 (code, byte) pairs: subnormal results, NaN codes, byte 255 (inf / NaN)."""
    codes = np.tile(np.arange(256, dtype=np.uint8), 2)  # 512 dims: every code twice
    want = np.empty((256, 512), np.float32)
    got = np.empty((256, 512), np.uint16)
    for byte in range(256):
        sc = np.full(16, byte, np.uint8)
        want[byte] = V.decode(codes[None], sc[None], REC)[0]
        LIB.dsv4_decode_mxfp8_bf16(codes.ctypes.data, sc.ctypes.data, got[byte].ctypes.data)
    got32 = (got.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(got32, want, equal_nan=True)
    nan = np.isnan(want)
    assert (got[nan] == 0x7FC0).all()  # one NaN pattern


def gather(out, pages, seq, glen, bt, S, offset, interleaved, threads=2):
    f32 = out.dtype == np.float32
    rc = LIB.dsv4_gather_mxfp8(
        out.ctypes.data,
        out.shape[1] * 512,
        512,
        out.shape[1],
        int(f32),
        pages.ctypes.data,
        pages.strides[0],
        pages.shape[0],
        S,
        interleaved,
        seq.ctypes.data,
        None if glen is None else glen.ctypes.data,
        bt.ctypes.data,
        0,
        bt.shape[1],
        bt.shape[1],
        offset,
        seq.shape[0],
        ctypes.byref(C.parallel(threads)),
    )
    C.check(rc)


@pytest.mark.parametrize("layout", V.LAYOUTS)
def test_gather_equals_numpy_with_threads(layout):
    rng = np.random.default_rng(3)
    S, nb = 16, 700
    base = rng.integers(0, 256, (nb, S * 528 + 64), dtype=np.uint8)  # random bytes, padded pages
    pages = np.lib.stride_tricks.as_strided(base, (nb, S, 528), (S * 528 + 64, 528, 1))
    seq = np.array([nb * S, 9, 5 * S], np.int64)
    glen = np.array([nb * S - 1, 9, 2 * S + 1], np.int64)  # > DSV4_GATHER_PARALLEL_ROWS: threads split it
    bt = np.stack([rng.permutation(nb) for _ in range(3)]).astype(np.int32)
    want = np.full((3, nb * S + 2, 512), 5.0, np.float32)
    V.dequantize_and_gather_k_cache(want, pages, seq, glen, bt, offset=1, layout=layout)
    for threads in (1, 3):  # an output over DSV4_GATHER_STREAM_BYTES: non-temporal stores
        out = np.full(want.shape, 5.0, np.float32)
        gather(out, base, seq, glen, bt, S, 1, int(layout == "interleaved"), threads)
        assert np.array_equal(out, want, equal_nan=True)
    bits = np.full(want.shape, 0x40A0, np.uint16)  # bf16 out (5.0)
    gather(bits, base, seq, glen, bt, S, 1, int(layout == "interleaved"), 2)
    assert np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), want, equal_nan=True)


def test_rows_outside_the_cache_read_nan():
    S = 4
    base = np.zeros((2, S * 528), np.uint8)
    out = np.zeros((1, 12, 512), np.float32)
    bt = np.array([[1, 7, -1]], np.int32)  # page 7 and -1 are not pages
    gather(out, base, np.array([12], np.int64), None, bt, S, 0, 1)
    assert (out[0, :4] == 0).all() and np.isnan(out[0, 4:]).all()


def test_bad_arguments_are_named():
    base = np.zeros((2, 4 * 528), np.uint8)
    out = np.zeros((1, 4, 512), np.float32)
    bt = np.zeros((1, 1), np.int32)
    seq = np.array([4], np.int64)
    with pytest.raises(ValueError, match="page_stride: 2000 < page_size \\* 528"):
        C.check(
            LIB.dsv4_gather_mxfp8(
                out.ctypes.data,
                2048,
                512,
                4,
                1,
                base.ctypes.data,
                2000,
                2,
                4,
                1,
                seq.ctypes.data,
                None,
                bt.ctypes.data,
                0,
                1,
                1,
                0,
                1,
                None,
            )
        )
    with pytest.raises(ValueError, match="interleaved: expected 0 or 1, got 2"):
        C.check(
            LIB.dsv4_gather_mxfp8(
                out.ctypes.data,
                2048,
                512,
                4,
                1,
                base.ctypes.data,
                2112,
                2,
                4,
                2,
                seq.ctypes.data,
                None,
                bt.ctypes.data,
                0,
                1,
                1,
                0,
                1,
                None,
            )
        )
    neg = np.array([-1], np.int64)
    with pytest.raises(ValueError, match="seq_lens\\[0\\]: -1 < 0"):
        C.check(
            LIB.dsv4_gather_mxfp8(
                out.ctypes.data,
                2048,
                512,
                4,
                1,
                base.ctypes.data,
                2112,
                2,
                4,
                1,
                neg.ctypes.data,
                None,
                bt.ctypes.data,
                0,
                1,
                1,
                0,
                1,
                None,
            )
        )
