"""vLLM's `fp8_ds_mla` KV cache pages: the NumPy reference (planner.kvcache) and dsv4_torch.kvcache.

The reference is checked against the layout facts by hand (byte offsets, UE8M0 bytes, e4m3 codes
worked out on paper); the torch backends (vectorized torch, and the Triton kernels, interpreted
on CPU) against the reference, byte for byte and value for value.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import torch

from dsv4_torch import kvcache as TK
from planner import kvcache as P
from planner.contract import BackendUnavailableError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Triton's interpreter multiplies with NumPy: scale byte 255 (2^128 = inf) warns there, as intended.
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered in multiply:RuntimeWarning",
    "ignore:invalid value encountered in multiply:RuntimeWarning",
)

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


def bf16(x) -> np.ndarray:
    """float32 copy of x rounded to bf16 values."""
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def random_tokens(rng, T, scales=(1e-3, 0.1, 1.0, 30.0, 1e4)):
    k = rng.standard_normal((T, 512)) * rng.choice(scales, (T, 1))
    return bf16(k)


def edge_tokens():
    """Rows that hit each rule: all-zero groups (amax floor), +-448 (saturation, e = 0), exact powers
    of two times 448, tiny and huge magnitudes, bf16 subnormals, -0, RoPE extremes."""
    k = np.zeros((10, 512), np.float32)
    k[1, :64] = 448.0
    k[1, 64:128] = -448.0
    k[2, :64] = 448.0 * 2.0**-20  # e = -20 exactly (a power of two: no round-up)
    k[2, 64:128] = 448.0 * 2.0**-20 * 1.0078125  # the next bf16 up: e = -19
    k[3, :448] = 3.3895313892515355e38  # bf16 max: e = 120, byte 247; dequantizes to inf (256 * 2^120)
    k[4, :448] = 1e-30  # tiny: amax floor 1e-4 -> e = -22, codes 0
    k[5, :448] = np.float32(9.2e-41)  # bf16 subnormal
    k[6, :448] = -0.0
    k[6, 448:] = np.array([3.3895313892515355e38, -1e-40, -0.0, 1.0] * 16, np.float32)
    rng = np.random.default_rng(1)
    k[7] = rng.standard_normal(512) * 1e-4  # amax near the floor
    k[8, ::2] = 1.0
    k[8, 1::2] = 1.0 + 1 / 16  # e4m3 ties: 1.0625 -> 1.0 (even), with e = -8: scaled by 256
    k[9] = rng.standard_normal(512) * 2.0**100
    return bf16(k)


def fresh_cache(rng, num_blocks, S):
    return rng.integers(0, 256, (num_blocks, P.page_bytes(S)), dtype=np.uint8)


# ------------------------------------------------------------------------------------------
# the reference against the layout facts


@pytest.mark.parametrize("S, want", [(64, 37440), (16, 9792), (2, 1728), (1, 1152), (4, 2880)])
def test_page_bytes(S, want):
    assert P.page_bytes(S) == want == -(-S * 584 // 576) * 576


def test_one_slot_by_hand():
    """Byte offsets, scale bytes and codes of one token, worked out from the layout table."""
    S, p = 2, 1
    k = np.zeros((1, 512), np.float32)
    k[0, 0] = 1.0  # group 0: amax 1 -> e = ceil(log2(1/448)) = -8; 1 * 256 = 256 -> e4m3 0x78
    k[0, 1] = -0.5  # -128 -> 0xF0
    k[0, 64] = 448.0  # group 1: e = 0, 448 -> 0x7E
    k[0, 65] = 1.98  # bf16 1.984375 -> e4m3 2.0 (a carry into the exponent): 0x40
    k[0, 448] = 1.0  # RoPE: bf16 0x3F80, little-endian 80 3F
    k[0, 511] = -2.0  # bf16 0xC000
    k = bf16(k)
    cache = np.full((1, P.page_bytes(S)), 0xAA, np.uint8)
    P.quantize_and_insert_k_cache(k, cache, np.array([p]), S)
    page = cache[0]
    slot = page[p * 576 : p * 576 + 576]
    assert slot[0] == 0x78 and slot[1] == 0xF0 and slot[2] == 0x00
    assert slot[64] == 0x7E and slot[65] == 0x40
    assert list(slot[448:450]) == [0x80, 0x3F] and list(slot[574:576]) == [0x00, 0xC0]
    scales = page[S * 576 + p * 8 : S * 576 + p * 8 + 8]
    # group 0: 127 - 8; group 1: 127; groups 2..6 all zero: amax floor 1e-4 -> e = -22 -> 105; byte 7 = 0
    assert list(scales) == [119, 127, 105, 105, 105, 105, 105, 0]
    # nothing else touched: slot 0, slot 0's scales, the tail padding
    assert (page[:576] == 0xAA).all() and (page[S * 576 : S * 576 + 8] == 0xAA).all()
    assert (page[S * 584 :] == 0xAA).all()
    out = np.zeros((1, 2, 512), np.float32)
    P.dequantize_and_gather_k_cache(out, cache, np.array([2]), np.array([1]), np.array([[0]]), S, 1)
    assert out[0, 0].tolist() == [0.0] * 512  # offset 1: row 0 untouched
    got = out[0, 1]
    assert got[0] == 1.0 and got[1] == -0.5 and got[64] == 448.0 and got[65] == 2.0
    assert got[448] == 1.0 and got[511] == -2.0


def test_scale_exponent_exact_for_every_bf16():
    """The bit formula equals ceil(log2(amax / 448)) (float64) for every positive finite bf16 and the floor."""
    bits = np.arange(1, 0x7F80, dtype=np.uint16)
    amax = bits.view(BF16).astype(np.float32)
    got = P.scale_exponent(amax)
    want = np.ceil(np.log2(np.maximum(amax, np.float32(1e-4)).astype(np.float64) / 448.0)).astype(np.int32)
    assert np.array_equal(got, want)
    torch_e = TK.exponents(torch.from_numpy(amax)).numpy()
    assert np.array_equal(torch_e, want)
    assert got.min() == -22 and got.max() == 120  # scale bytes 105..247: the clamp never binds


def test_cast_is_rtne_saturating():
    """ml_dtypes' e4m3 cast (the reference's) on hand-checked values: ties to even, carries, saturation."""
    x = np.array([1.0625, 1.1875, 1.98, 15.5, 464.0, 448.0, 2.0**-10, 3 * 2.0**-10, -(2.0**-10)], np.float32)
    x = np.clip(x, -448, 448)
    codes = x.astype(E4M3).view(np.uint8).tolist()
    assert codes == [0x38, 0x3A, 0x40, 0x58, 0x7E, 0x7E, 0x00, 0x02, 0x80]


def test_round_trip_error_and_edges():
    k = np.concatenate([edge_tokens(), random_tokens(np.random.default_rng(0), 64)])
    T, S = k.shape[0], 16
    cache = np.zeros((5, P.page_bytes(S)), np.uint8)
    P.quantize_and_insert_k_cache(k, cache, np.arange(T), S)
    out = np.zeros((1, T, 512), np.float32)
    P.dequantize_and_gather_k_cache(out, cache, np.array([T]), None, np.arange(5)[None], S, 0)
    got = out[0]
    assert np.array_equal(got[:, 448:], k[:, 448:])  # RoPE dims exact
    assert np.isinf(got[3, :448]).all()  # bf16 max rounds to 256 * 2^120 = 2^128: inf in float32
    fin = np.isfinite(got[:, :448]).all(axis=1)
    x, y = k[fin, :448].reshape(-1, 7, 64), got[fin, :448].reshape(-1, 7, 64)
    scale = np.exp2(P.scale_exponent(np.abs(x).max(-1)))[..., None]
    # half an e4m3 ulp: 2^-4 relative for normal codes, 2^-10 (times the scale) for subnormal ones
    assert (np.abs(y - x) <= np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-10)).all()
    assert (got[1, :64] == 448).all() and (got[1, 64:128] == -448).all()  # saturation point exact
    assert (got[4, :448] == 0).all() and (got[6, :448] == 0).all()


def test_slot_minus_one_and_padding_untouched():
    rng = np.random.default_rng(2)
    S, nb = 16, 4
    cache = fresh_cache(rng, nb, S)
    before = cache.copy()
    k = random_tokens(rng, 5)
    slots = np.array([3, -1, 17, -1, 63])
    P.quantize_and_insert_k_cache(k, cache, slots, S)
    written = np.zeros_like(cache, bool)
    for s in (3, 17, 63):
        pg, p = divmod(s, S)
        written[pg, p * 576 : p * 576 + 576] = True
        written[pg, S * 576 + p * 8 : S * 576 + p * 8 + 8] = True
    assert np.array_equal(cache[~written], before[~written])
    assert not np.array_equal(cache[written], before[written])


def test_gather_positions_and_offsets():
    """Row i of request b is position seq - gather + i, from block_table[b, pos // S]: checked
    against single-slot gathers with a scrambled block table."""
    rng = np.random.default_rng(3)
    S, nb = 2, 12
    cache = np.zeros((nb, P.page_bytes(S)), np.uint8)
    k = random_tokens(rng, nb * S)
    P.quantize_and_insert_k_cache(k, cache, np.arange(nb * S), S)
    bt = np.stack([rng.permutation(nb), rng.permutation(nb)]).astype(np.int32)
    seq, gl = np.array([9, 20], np.int32), np.array([4, 0], np.int32)
    out = np.full((3, 12, 512), 5.0, np.float32)
    P.dequantize_and_gather_k_cache(out, cache, seq, gl, bt, S, 7)
    for i in range(4):
        pos = 9 - 4 + i
        slot = bt[0, pos // S] * S + pos % S
        row = np.zeros((1, 1, 512), np.float32)
        P.dequantize_and_gather_k_cache(row, cache, np.array([slot + 1]), np.array([1]), np.arange(nb)[None], S, 0)
        assert np.array_equal(out[0, 7 + i], row[0, 0])
    assert (out[0, :7] == 5).all() and (out[0, 11:] == 5).all() and (out[1:] == 5).all()


# ------------------------------------------------------------------------------------------
# bad inputs (the reference; torch and JAX share these checks)


def _args():
    S = 16
    return dict(
        k=random_tokens(np.random.default_rng(0), 4),
        cache=np.zeros((3, P.page_bytes(S)), np.uint8),
        slots=np.array([0, 1, -1, 47]),
        S=S,
    )


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(cache=np.zeros((3, 9793), np.uint8)), ValueError, "page stride 9793 bytes is not round_up"),
        (dict(cache=np.zeros((3, 9792), np.int8)), TypeError, "k_cache: expected uint8"),
        (dict(cache=np.zeros((3, 9792), np.float32)), TypeError, "k_cache: expected uint8"),
        (dict(cache=np.zeros((3, 2, 584), np.uint8)), ValueError, "k_cache: expected shape"),
        (dict(slots=np.array([0, 1, -2, 3])), ValueError, r"slot_mapping\[2\] = -2"),
        (dict(slots=np.array([0, 1, 48, 3])), ValueError, r"slot_mapping\[2\] = 48 .* 48\)"),
        (dict(slots=np.array([0, 1, 1, 3])), ValueError, "slot 1 appears more than once"),
        (dict(slots=np.arange(5)), ValueError, "slot_mapping: 5 entries for 4 tokens"),
        (dict(slots=np.array([0.0, 1.0])), TypeError, "slot_mapping: expected integers"),
        (dict(k=np.zeros((4, 576), np.float32)), ValueError, r"k: expected shape \[T, 512\]"),
        (dict(k=np.zeros((4, 512), np.float64)), TypeError, "k: expected float32"),
        (dict(k=np.full((4, 512), 1.001, np.float32)), ValueError, "k: must hold bf16 values"),
        (dict(k=np.full((4, 512), np.inf, np.float32)), ValueError, "k: must be finite"),
        (dict(S=0), ValueError, "block_size: expected a positive integer"),
        (dict(S=True), ValueError, "block_size"),
    ],
)
def test_insert_rejects(change, exc, match):
    a = {**_args(), **change}
    with pytest.raises(exc, match=match):
        P.quantize_and_insert_k_cache(a["k"], a["cache"], a["slots"], a["S"])


def _gargs():
    S = 16
    return dict(
        out=np.zeros((2, 40, 512), np.float32),
        cache=np.zeros((4, P.page_bytes(S)), np.uint8),
        seq=np.array([20, 30]),
        gl=np.array([5, 30]),
        bt=np.array([[1, 2, -1], [3, 0, 9]]),
        S=S,
        off=10,
    )


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(gl=np.array([5, 31])), ValueError, r"gather_lens\[1\] = 31 with seq_lens\[1\] = 30"),
        (dict(gl=np.array([-1, 3])), ValueError, r"gather_lens\[0\] = -1"),
        (dict(gl=np.array([5])), ValueError, "gather_lens: expected 2 entries"),
        (dict(seq=np.array([-3, 30])), ValueError, r"seq_lens\[0\] = -3"),
        (dict(off=11), ValueError, "40 rows per request are too few for offset 11"),
        (dict(off=-1), ValueError, "offset: must be >= 0"),
        (dict(out=np.zeros((1, 40, 512), np.float32)), ValueError, r"out: expected >= 2 requests"),
        (dict(out=np.zeros((2, 40, 512), np.float64)), TypeError, "out: expected float32"),
        (dict(out=np.zeros((2, 40, 576), np.float32)), ValueError, r"out: expected shape"),
        (dict(bt=np.array([[1, 2, -1], [3, 4, 9]])), ValueError, r"block_table: entry \[1, 1\] = 4 is not a page"),
        (dict(bt=np.array([[1, -1, 5], [3, 0, 9]])), ValueError, r"block_table: entry \[0, 1\] = -1"),
        (
            dict(seq=np.array([20, 49]), gl=np.array([5, 20])),
            ValueError,
            r"seq_lens\[1\] = 49 needs 4 pages of 16 slots",
        ),
        (dict(bt=np.array([[1, 2, 3]])), ValueError, "block_table: expected >= 2 rows"),
        (dict(bt=np.array([1, 2, 3])), ValueError, "block_table: expected a 2-D"),
        (dict(cache=np.zeros((4, 37440), np.uint8)), ValueError, r"page stride 37440 bytes is not round_up\(16"),
        (dict(cache=np.zeros((4, 9792), np.uint16)), TypeError, "k_cache: expected uint8"),
    ],
)
def test_gather_rejects(change, exc, match):
    """Each bad gather argument, named in the error (the arguments of _gargs() are valid)."""
    a = {**_gargs(), **change}
    with pytest.raises(exc, match=match):
        P.dequantize_and_gather_k_cache(a["out"], a["cache"], a["seq"], a["gl"], a["bt"], a["S"], a["off"])


def test_unread_block_table_entries_are_free():
    """Entries before the gathered window (and padding after it) may be anything, as in vLLM."""
    a = _gargs()
    bt = np.array([[-7, 2, -1], [3, 0, 99]])  # request 0 gathers positions 15..19: page column 0 (pos 15) is read
    with pytest.raises(ValueError, match=r"entry \[0, 0\] = -7"):
        P.dequantize_and_gather_k_cache(a["out"], a["cache"], a["seq"], a["gl"], bt, a["S"], a["off"])
    P.dequantize_and_gather_k_cache(a["out"], a["cache"], np.array([20, 30]), np.array([4, 30]), bt, a["S"], a["off"])


# ------------------------------------------------------------------------------------------
# torch against the reference


def _torch_backends():
    from dsv4_torch.kernels.triton import kvcache as triton_kvcache

    names = ["reference"]
    if triton_kvcache.INTERPRETED or torch.cuda.is_available():
        names.append("triton")
    return names


BACKENDS = pytest.mark.parametrize("backend", ["reference", "triton"])
GATHER_BACKENDS = pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])


def _need(backend):
    if backend == "cpu":
        reason = TK.cpu_unavailable_reason()
        if reason is not None:
            pytest.skip(f"the cpu backend's C kernel cannot be built here: {reason}")
        return
    if backend not in _torch_backends():
        pytest.skip("the triton backend needs a CUDA GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")


def _writer(backend):
    return "reference" if backend == "cpu" else backend  # the cpu backend has the gather only


@BACKENDS
@pytest.mark.parametrize("S", [64, 16, 2])
def test_torch_insert_bytes_equal_reference(backend, S):
    _need(backend)
    rng = np.random.default_rng(S)
    nb = 6
    k = np.concatenate([edge_tokens(), random_tokens(rng, 40)])
    slots = rng.permutation(nb * S)[: k.shape[0]]
    slots[::5] = -1
    cache = fresh_cache(rng, nb, S)
    want = cache.copy()
    P.quantize_and_insert_k_cache(k, want, slots, S)
    got = torch.from_numpy(cache.copy())
    TK.quantize_and_insert_k_cache(torch.from_numpy(k).bfloat16(), got, torch.from_numpy(slots), S, backend=backend)
    assert np.array_equal(got.numpy(), want)


@GATHER_BACKENDS
@pytest.mark.parametrize("S", [64, 2])
def test_torch_gather_equals_reference_on_any_bytes(backend, S):
    """Random page bytes (every e4m3 code incl. NaN and subnormals, every scale byte 0..255)."""
    _need(backend)
    rng = np.random.default_rng(10 + S)
    nb = 7
    cache = fresh_cache(rng, nb, S)
    R = 3
    seq = np.array([nb * S, 5, 3 * S + 1], np.int32)
    gl = np.array([nb * S, 0, 2 * S - 1], np.int32)
    bt = np.stack([rng.permutation(nb) for _ in range(R)]).astype(np.int32)
    rows = nb * S + 3
    want = np.full((R + 1, rows, 512), -3.0, np.float32)
    P.dequantize_and_gather_k_cache(want, cache, seq, gl, bt, S, 2)
    got = torch.full((R + 1, rows, 512), -3.0, dtype=torch.bfloat16)
    t = torch.from_numpy
    TK.dequantize_and_gather_k_cache(got, t(cache), t(seq), t(gl), t(bt), S, 2, backend=backend)
    assert np.array_equal(got.float().numpy(), want, equal_nan=True)


@GATHER_BACKENDS
def test_torch_round_trip_through_vllm_view(backend):
    """vLLM's nominal [num_blocks, S, 584] view with page stride page_bytes(S); gather_lens None."""
    _need(backend)
    rng = np.random.default_rng(4)
    S, nb = 16, 3
    flat = torch.zeros(nb * P.page_bytes(S), dtype=torch.uint8)
    view = flat.as_strided((nb, S, 584), (P.page_bytes(S), 584, 1))
    k = random_tokens(rng, nb * S)
    TK.quantize_and_insert_k_cache(
        torch.from_numpy(k).bfloat16(), view, torch.arange(nb * S), S, backend=_writer(backend)
    )
    want = np.zeros((nb, P.page_bytes(S)), np.uint8)
    P.quantize_and_insert_k_cache(k, want, np.arange(nb * S), S)
    assert np.array_equal(flat.numpy().reshape(nb, -1), want)
    out = torch.zeros((1, nb * S, 512), dtype=torch.bfloat16)
    TK.dequantize_and_gather_k_cache(
        out, view, torch.tensor([nb * S]), None, torch.tensor([[2, 0, 1]]), S, 0, backend=backend
    )
    ref = np.zeros((1, nb * S, 512), np.float32)
    P.dequantize_and_gather_k_cache(ref, want, np.array([nb * S]), None, np.array([[2, 0, 1]]), S, 0)
    assert np.array_equal(out.float().numpy(), ref)


@GATHER_BACKENDS
def test_torch_gather_into_strided_out(backend):
    """out whose rows are not contiguous (a slice of a wider buffer): every path writes in place."""
    _need(backend)
    rng = np.random.default_rng(6)
    S, nb = 16, 4
    cache = np.zeros((nb, P.page_bytes(S)), np.uint8)
    P.quantize_and_insert_k_cache(random_tokens(rng, nb * S), cache, np.arange(nb * S), S)
    seq, gl = np.array([nb * S, 20, 3], np.int32), np.array([nb * S, 5, 3], np.int32)  # long and short requests
    bt = np.stack([rng.permutation(nb) for _ in range(3)]).astype(np.int32)
    want = np.full((3, nb * S, 512), 2.0, np.float32)
    P.dequantize_and_gather_k_cache(want, cache, seq, gl, bt, S, 0)
    wide = torch.full((3, nb * S, 1024), 2.0, dtype=torch.bfloat16)
    out = wide[:, :, 256:768]
    t = torch.from_numpy
    TK.dequantize_and_gather_k_cache(out, t(cache), t(seq), t(gl), t(bt), S, 0, backend=backend)
    assert np.array_equal(out.float().numpy(), want)
    assert (wide[:, :, :256] == 2).all() and (wide[:, :, 768:] == 2).all()


def test_triton_hardware_cast_branch_on_representable_inputs():
    """The GPU branch (hardware e4m3 cast) run by the interpreter, on values the cast need not round:
    the interpreter's cast is wrong on rounding carries (shared/docs/real-formats.md), so random
    inputs would fail there, while these pass. The default interpreted branch rounds by integers."""
    from dsv4_torch.kernels.triton import kvcache as triton_kvcache

    if not triton_kvcache.INTERPRETED:
        pytest.skip("checks the interpreter (CPU, TRITON_INTERPRET=1); on a GPU the other tests cover this branch")
    rng = np.random.default_rng(5)
    S, nb, T = 16, 2, 20
    codes = rng.integers(0, 256, (T, 448), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    vals = codes.view(E4M3).astype(np.float32)
    vals[:, ::64] = 448.0  # each group's amax = 448: e = 0, the codes are stored as they are
    e = rng.integers(-20, 100, (T, 7))
    k = np.zeros((T, 512), np.float32)
    k[:, :448] = (vals.reshape(T, 7, 64) * np.exp2(e)[..., None]).reshape(T, 448)
    k[:, 448:] = random_tokens(rng, T)[:, 448:]
    assert np.array_equal(bf16(k), k)  # e4m3 * 2^e is a bf16 value
    want = np.zeros((nb, P.page_bytes(S)), np.uint8)
    P.quantize_and_insert_k_cache(k, want, np.arange(T), S)
    got = torch.zeros((nb, P.page_bytes(S)), dtype=torch.uint8)
    kt = torch.from_numpy(k).bfloat16()
    triton_kvcache.quantize_insert(kt, got, torch.arange(T), S, hw_cast=True)
    assert np.array_equal(got.numpy(), want)


def test_torch_validate_and_types():
    S = 16
    cache = torch.zeros((3, P.page_bytes(S)), dtype=torch.uint8)
    k = torch.zeros((4, 512), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k_cache: expected uint8"):
        TK.quantize_and_insert_k_cache(k, cache.view(torch.int8), torch.arange(4), S)
    with pytest.raises(TypeError, match="k: expected bfloat16"):
        TK.quantize_and_insert_k_cache(k.float(), cache, torch.arange(4), S)
    with pytest.raises(ValueError, match=r"slot_mapping\[3\] = 48"):
        TK.quantize_and_insert_k_cache(k, cache, torch.tensor([0, 1, 2, 48]), S)
    with pytest.raises(ValueError, match="k: must be finite"):
        TK.quantize_and_insert_k_cache(k.clone().fill_(float("nan")), cache, torch.arange(4), S)
    with pytest.raises(ValueError, match="page stride 9793"):
        TK.quantize_and_insert_k_cache(k, torch.zeros((3, 9793), dtype=torch.uint8), torch.arange(4), S)
    with pytest.raises(ValueError, match="page stride 9800"):  # rows of a wider buffer
        TK.quantize_and_insert_k_cache(k, torch.zeros((3, 9800), dtype=torch.uint8)[:, :9792], torch.arange(4), S)
    with pytest.raises(ValueError, match=r"a 3-D page view must be \[num_blocks, 16, 584\]"):
        TK.quantize_and_insert_k_cache(k, torch.zeros((3, 8, 584), dtype=torch.uint8), torch.arange(4), S)
    with pytest.raises(ValueError, match="backend"):
        TK.quantize_and_insert_k_cache(k, cache, torch.arange(4), S, backend="cuda")
    out = torch.zeros((2, 8, 512), dtype=torch.bfloat16)
    seq, bt = torch.tensor([8, 4], dtype=torch.int32), torch.tensor([[0], [1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"gather_lens\[1\] = 5 with seq_lens\[1\] = 4"):
        TK.dequantize_and_gather_k_cache(out, cache, seq, torch.tensor([8, 5], dtype=torch.int32), bt, S, 0)
    with pytest.raises(ValueError, match=r"entry \[1, 0\] = 3 is not a page"):
        TK.dequantize_and_gather_k_cache(out, cache, seq, None, torch.tensor([[0], [3]], dtype=torch.int32), S, 0)
    with pytest.raises(ValueError, match="8 rows per request are too few for offset 1"):
        TK.dequantize_and_gather_k_cache(out, cache, seq, None, bt, S, 1)
    with pytest.raises(TypeError, match="out: expected bfloat16"):
        TK.dequantize_and_gather_k_cache(out.float(), cache, seq, None, bt, S, 0)
    with pytest.raises(TypeError, match="seq_lens: expected int32"):
        TK.dequantize_and_gather_k_cache(out, cache, seq.float(), None, bt, S, 0)
    with pytest.raises(ValueError, match="out: expected unit stride"):
        TK.dequantize_and_gather_k_cache(out.transpose(1, 2).contiguous().transpose(1, 2), cache, seq, None, bt, S, 0)
    # validate=False skips the value checks (and their host reads), never the shape/dtype ones
    TK.dequantize_and_gather_k_cache(out, cache, seq, None, bt, S, 0, validate=False)
    with pytest.raises(TypeError, match="out: expected bfloat16"):
        TK.dequantize_and_gather_k_cache(out.float(), cache, seq, None, bt, S, 0, validate=False)


def test_torch_resolve_backend():
    cache = torch.zeros((1, P.page_bytes(2)), dtype=torch.uint8)
    cpu_ok = TK.cpu_unavailable_reason() is None
    # CPU pages: never the interpreter; the C kernel for gathers where it builds
    assert TK.resolve_backend("auto", cache) == ("cpu" if cpu_ok else "reference")
    assert TK.resolve_backend("auto", cache, op="insert") == "reference"
    assert TK.resolve_backend("reference", cache) == "reference"
    with pytest.raises(BackendUnavailableError, match="gather only"):
        TK.resolve_backend("cpu", cache, op="insert")
    with pytest.raises(BackendUnavailableError, match="gather only"):
        TK.quantize_and_insert_k_cache(
            torch.zeros((1, 512), dtype=torch.bfloat16), cache, torch.tensor([0]), 2, backend="cpu"
        )
    with pytest.raises(ValueError, match="op"):
        TK.resolve_backend("auto", cache, op="write")


def test_cpu_backend_without_a_compiler(tmp_path):
    """No C compiler: auto keeps the torch path (the same bits), backend='cpu' names the reason."""
    import subprocess
    import sys

    code = (
        "import torch; from dsv4_torch import kvcache as TK; from planner.contract import BackendUnavailableError\n"
        "c = torch.zeros((1, TK.page_bytes(2)), dtype=torch.uint8)\n"
        "assert TK.resolve_backend('auto', c) == 'reference'\n"
        "try:\n    TK.resolve_backend('cpu', c)\nexcept BackendUnavailableError as e:\n    print(e)\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), DSV4_PREFILL_CACHE=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "backend='cpu' cannot run here" in res.stdout and "no-such-cc" in res.stdout


def test_cpu_kernel_fast_and_edge_paths():
    """The C kernel's three group paths (normal codes only; subnormal or NaN codes present; scale
    bytes outside 10..246) at their boundaries, and calls split across threads mid-request."""
    _need("cpu")
    from dsv4_cpu import binding
    from dsv4_torch.kernels.cpu import kvcache as cpu

    rng = np.random.default_rng(21)
    S, nb = 16, 9
    cache = fresh_cache(rng, nb, S)
    data = cache[:, : S * 576].reshape(nb, S, 576)[:, :, :448].reshape(nb, S, 7, 64)
    code = data & 0x7F
    plain = rng.random((nb, S, 7)) < 0.6  # these groups: normal and zero codes only
    fixed = np.where(((code >= 1) & (code <= 7)) | (code == 0x7F), (data & 0x80) | 0x45, data)
    data[plain] = fixed[plain]
    data[..., 0] = np.where(plain, 0x80, data[..., 0])  # -0 in the fast path keeps its sign
    special = lambda c: ((c >= 1) & (c <= 7)) | (c == 0x7F)
    assert not special(data[plain] & 0x7F).any() and special(data[~plain] & 0x7F).any(axis=-1).mean() > 0.9
    cache[:, : S * 576].reshape(nb, S, 576)[:, :, :448] = data.reshape(nb, S, 448)
    scales = cache[:, S * 576 : S * 584].reshape(nb, S, 8)
    scales[:, :, :7] = rng.choice(np.array([0, 1, 9, 10, 11, 127, 245, 246, 247, 254, 255], np.uint8), (nb, S, 7))
    R = 4
    seq = np.array([nb * S, 37, 5 * S + 3, 0], np.int32)
    gl = np.array([nb * S - 1, 37, 2 * S + 5, 0], np.int32)
    bt = np.stack([rng.permutation(nb) for _ in range(R)]).astype(np.int64)
    want = np.zeros((R, nb * S, 512), np.float32)
    P.dequantize_and_gather_k_cache(want, cache, seq, gl, bt, S, 0)
    t = torch.from_numpy
    lib = binding.library()
    seq64 = seq.astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(gl)]).astype(np.int64)
    for threads, pieces in ((1, 1), (3, 3), (5, 7)):
        for dtype in (torch.bfloat16, torch.float32):
            got = torch.zeros((R, nb * S, 512), dtype=dtype)
            if pieces == 1:
                cpu.gather_dequant(got, t(cache), t(seq), t(gl), t(bt), S, 0, threads=threads)
            else:  # one thread's share at a time, split mid-request
                n = int(cum[-1])
                for k in range(pieces):
                    lib.dsv4_gather_dequant_rows(
                        got.data_ptr(),
                        got.stride(0),
                        got.stride(1),
                        got.shape[1],
                        int(dtype == torch.float32),
                        0,
                        cache.ctypes.data,
                        cache.shape[1],
                        nb,
                        S,
                        seq64.ctypes.data,
                        cum.ctypes.data,
                        bt.ctypes.data,
                        1,
                        bt.shape[1],
                        bt.shape[1],
                        0,
                        R,
                        n * k // pieces,
                        n * (k + 1) // pieces,
                    )
            g = got.float().numpy()
            assert np.array_equal(g, want, equal_nan=True), (threads, dtype)
            finite = ~np.isnan(want)
            assert np.array_equal(np.signbit(g[finite]), np.signbit(want[finite]))


def _ptxas_available():
    try:
        import triton
    except ImportError:
        return False
    import os

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _ptxas_available(), reason="needs Triton's bundled ptxas (NVIDIA build of triton)")
def test_triton_kernels_compile_for_gpus():
    """Ahead-of-time compile for H100/H200 (sm_90) and A100 (sm_80), no GPU needed: what the
    interpreter cannot see. sm_90 converts e4m3 in hardware, sm_80 in integers; both move the
    slot bytes and bf16 rows with 16-byte vector loads and stores (so does the prefill's gather
    of bf16 caches, `dsv4_torch.kernels.triton.gather`)."""
    import os
    import re
    import subprocess
    import sys

    code = (
        "import re, json\n"
        "from dsv4_torch.kernels.triton import kvcache as K\n"
        "out = {}\n"
        "for arch in (90, 80):\n"
        "    for name, ptx in K.compile_for(arch).items():\n"
        "        out[f'{arch}-{name}'] = [len(re.findall(p, ptx)) for p in (r'ld\\.global(?:\\.\\w+)*\\.v4', r'st\\.global(?:\\.\\w+)*\\.v4', r'e4m3')]\n"
        "from dsv4_torch.kernels.triton import gather as G\n"
        "for arch in (90, 80):\n"
        "    for name, ptx in G.compile_for(arch).items():\n"
        "        out[f'{arch}-rows-{name}'] = [len(re.findall(p, ptx)) for p in (r'ld\\.global(?:\\.\\w+)*\\.v4', r'st\\.global(?:\\.\\w+)*\\.v4')]\n"
        "print('COUNTS', json.dumps(out))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    m = re.search(r"COUNTS (.*)", res.stdout)
    assert m, res.stdout + res.stderr[-3000:]
    import json

    c = json.loads(m.group(1))
    assert c["90-gather"][0] > 0 and c["90-gather"][1] > 0 and c["90-gather"][2] > 0
    assert c["90-insert"][2] > 0  # cvt ... e4m3x2
    assert c["80-gather"][2] == 0 and c["80-insert"][2] == 0 and c["80-gather"][1] > 0
    # the prefill's gather of caches in q's dtype (dsv4_torch.kernels.triton.gather), paged and packed
    assert all(c[f"{a}-rows-{n}"][0] > 0 and c[f"{a}-rows-{n}"][1] > 0 for a in (90, 80) for n in ("paged", "packed"))


def test_torch_copy_and_gather_slots_move_bytes():
    """copy_slots / gather_slots move a slot's 576 data and 8 scale bytes, aligned or not."""
    rng = np.random.default_rng(5)
    S, nb = 4, 5
    src = torch.from_numpy(rng.integers(0, 256, (nb, P.page_bytes(S)), dtype=np.uint8))
    slots = torch.tensor([3, 0, 19, 7, 7, 12])

    def slot_bytes(pages, s):
        p, q = divmod(int(s), S)
        pg = pages[p]
        return torch.cat([pg[q * 576 : (q + 1) * 576], pg[S * 576 + q * 8 : S * 576 + q * 8 + 8]])

    out = TK.gather_slots(src, slots, S)
    assert out.shape == (2, P.page_bytes(S))
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(slot_bytes(out, i), slot_bytes(src, s))
    assert not out[1, 2 * 576 : S * 576].any()  # slots past n stay zero
    odd = torch.zeros(nb * P.page_bytes(S) + 1, dtype=torch.uint8)
    odd[1:] = src.reshape(-1)
    assert torch.equal(TK.gather_slots(odd[1:].view(nb, -1), slots, S), out)  # not 8-byte aligned: bytes
    dst = torch.zeros_like(src)
    TK.copy_slots(src, torch.tensor([1, 2]), dst, torch.tensor([9, 0]), S)
    assert torch.equal(slot_bytes(dst, 9), slot_bytes(src, 1)) and torch.equal(slot_bytes(dst, 0), slot_bytes(src, 2))
    with pytest.raises(ValueError, match=r"dst_slots: 1 slots for 2 source slots"):
        TK.copy_slots(src, torch.tensor([1, 2]), dst, torch.tensor([9]), S)
    with pytest.raises(TypeError, match=r"dst_cache: expected uint8 pages"):
        TK.copy_slots(src, torch.tensor([1]), dst.float(), torch.tensor([9]), S)


def test_cpu_kernel_never_reads_or_writes_outside_and_ignores_ftz():
    """Unvalidated calls (what a traced JAX call is): a block-table entry that is not a page, a
    gather_len past seq_len, rows past out: NaN rows or no write, never a stray access. And a
    thread that flushes float subnormals (torch.set_flush_denormal; XLA's CPU threads) gets the
    same bits: the decode is integer math."""
    _need("cpu")
    rng = np.random.default_rng(22)
    S, nb = 16, 4
    cache = fresh_cache(rng, nb, S)
    cache[:, S * 576 : S * 584].reshape(nb, S, 8)[:, :, :7] = rng.integers(0, 12, (nb, S, 7))  # subnormal products
    seq = np.array([3 * S, 2 * S, 5, 40], np.int32)
    gl = np.array([3 * S, 2 * S, 9, 40], np.int32)  # request 2: 9 rows of a 5-token request
    bt = np.array([[0, 1, 2, 3], [3, nb + 5, 1, 0], [2, 0, 0, 0], [1, -7, 2, 3]], np.int32)
    big = torch.full((4, 3 * S + 8, 512), 7.0, dtype=torch.bfloat16)
    out = big[:, : 3 * S - 4]  # rows past 3S - 4 (offset 0): not written
    t = torch.from_numpy
    was = torch.set_flush_denormal(True)
    try:
        TK.dequantize_and_gather_k_cache(out, t(cache), t(seq), t(gl), t(bt), S, 0, backend="cpu", validate=False)
    finally:
        torch.set_flush_denormal(False)
    assert was  # flushing is supported on this CPU (x86 SSE3 / ARM), so it was really on
    got = big.float().numpy()
    assert (got[:, 3 * S - 4 :] == 7).all()
    want = np.zeros((1, 3 * S, 512), np.float32)
    P.dequantize_and_gather_k_cache(want, cache, seq[:1], None, bt[:1], S, 0)
    assert np.array_equal(got[0, : 3 * S - 4], want[0, : 3 * S - 4], equal_nan=True)  # subnormals kept

    def rows(b, page_ids, positions):  # the reference's rows of those positions on those pages
        bt1 = np.array([page_ids], np.int32)
        w = np.zeros((1, len(positions), 512), np.float32)
        P.dequantize_and_gather_k_cache(
            w, cache, np.array([positions[-1] + 1], np.int32), np.array([len(positions)], np.int32), bt1, S, 0
        )
        return w[0]

    same = lambda a, b: np.array_equal(a, b, equal_nan=True)  # noqa: E731
    assert same(got[1, :S], rows(1, [3], list(range(S)))) and np.isnan(got[1, S : 2 * S]).all()  # page nb + 5
    assert np.isnan(got[2, :4]).all()  # positions -4 .. -1
    assert same(got[2, 4:9], rows(2, [2], list(range(5)))) and (got[2, 9:] == 7).all()
    assert same(got[3, :S], rows(3, [1], list(range(S)))) and np.isnan(got[3, S : 2 * S]).all()  # page -7
