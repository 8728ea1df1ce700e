"""dsv4_torch.kvcache_v41 against the NumPy reference (planner.kvcache_v41): the same bytes from
every writer, the same values from the gather (every record, both layouts, random pages with NaN
codes and extreme scale bytes, padded page strides), every backend that runs here, bad inputs."""

import numpy as np
import pytest
import torch

from dsv4_torch import kvcache_v41 as TV
from planner import kvcache_v41 as V
from planner.contract import BackendUnavailableError
from tests import v41_record_cases as C

REC = V.RECORDS
NAMES = [*REC, "index_fp8_mx"]  # the last: FP8 index keys with UE8M0 scales (mx_scales=True)


def record(name):
    return (V.MX_INDEX_FP8, {"mx_scales": True}) if name == "index_fp8_mx" else (REC[name], {})


def gather_backends(name):
    out = ["reference"]
    if name == "mxfp8" and TV.resolve_backend("auto", torch.zeros(1, dtype=torch.uint8), "gather_mxfp8") == "cpu":
        out.append("cpu")
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", V.LAYOUTS)
def test_insert_records_bytes_equal_numpys(name, layout):
    rng = np.random.default_rng(hash((name, layout)) % 1000)
    (r, mx), S, nb, T = record(name), 8, 5, 30
    x = C.rows(rng, T, r.dims, as_bf16=False)
    slots = C.slot_mapping(rng, T - 3, nb * S)  # fewer slots than rows, as vLLM pads
    start = C.random_pages(rng, nb, S, r, pad=32)
    want = start.copy()
    V.insert_records(x, want, slots, layout=layout, **mx)
    base = torch.from_numpy(np.lib.stride_tricks.as_strided(start, (nb * start.strides[0],), (1,)).copy())
    before = base.clone()
    pages = base.as_strided((nb, S, r.bytes), start.strides)
    TV.insert_records(torch.from_numpy(x), pages, torch.from_numpy(slots), layout=layout, **mx)
    assert np.array_equal(pages.numpy(), want)
    assert torch.equal(base.view(nb, -1)[:, S * r.bytes :], before.view(nb, -1)[:, S * r.bytes :])  # padding kept


@pytest.mark.parametrize("width", [528, 288])
def test_kv_writers_bytes_equal_numpys(width):
    rng = np.random.default_rng(width)
    S, nb, T = 4, 6, 23
    lat = C.rows(rng, T, 512)
    pos, cs = C.rope_case(rng, T, 2)
    slots = C.slot_mapping(rng, T, nb * S)
    for ratio in (1, 2):
        for layout in V.LAYOUTS:
            want = np.zeros((nb, S, width), np.uint8)
            V.rope_quant_insert(lat, pos, cs, want, slots, ratio, layout=layout)
            got = torch.zeros((nb, S, width), dtype=torch.uint8)
            TV.rope_quant_insert(
                torch.from_numpy(lat).bfloat16(),
                torch.from_numpy(pos),
                torch.from_numpy(cs),
                got,
                torch.from_numpy(slots),
                ratio,
                layout=layout,
            )
            assert np.array_equal(got.numpy(), want), (ratio, layout)
    want = np.zeros((nb, S, width), np.uint8)
    V.quantize_and_insert_k_cache(lat, want, slots)
    got = torch.zeros((nb, S * width), dtype=torch.uint8)  # 2-D pages
    TV.quantize_and_insert_k_cache(
        torch.from_numpy(lat).bfloat16(), got, torch.from_numpy(slots), S, bytes_per_token=width
    )
    assert np.array_equal(got.numpy().reshape(nb, S, width), want)


@pytest.mark.parametrize("fp4, mx", [(False, False), (True, False), (False, True)])
def test_index_writer_bytes_equal_numpys(fp4, mx):
    rng = np.random.default_rng(7 + fp4)
    S, nb, T, width = 8, 4, 29, 68 if fp4 else 132
    k_pre = C.bf16(rng.standard_normal((T, 128)) * 10.0 ** rng.integers(-8, 8, (T, 1)))
    w = C.bf16(rng.standard_normal(128))
    pos, cs = C.rope_case(rng, T, 1)
    slots = C.slot_mapping(rng, T, nb * S)
    for ratio, cs_t in ((1, torch.from_numpy(cs)), (2, torch.from_numpy(cs).bfloat16())):
        want = np.zeros((nb, S, width), np.uint8)
        V.indexer_k_norm_rope_store(k_pre, pos, cs_t.float().numpy(), w, 1e-6, want, slots, ratio, fp4, mx_scales=mx)
        got = torch.zeros((nb, S, width), dtype=torch.uint8)
        TV.indexer_k_norm_rope_store(
            torch.from_numpy(k_pre).bfloat16(),
            torch.from_numpy(pos),
            cs_t,
            torch.from_numpy(w),
            1e-6,
            got,
            torch.from_numpy(slots),
            ratio,
            fp4,
            mx_scales=mx,
        )
        assert np.array_equal(got.numpy(), want), ratio


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", V.LAYOUTS)
@pytest.mark.parametrize("S, pad", [(4, 8), (32, 0)])  # byte gathers; whole-row selects (vLLM's page strides)
def test_gather_values_equal_numpys(name, layout, S, pad):
    rng = np.random.default_rng(hash((name, layout, S)) % 1000)
    (r, mx), nb = record(name), 6
    pages = C.random_pages(rng, nb, S, r, pad=pad)
    if r.name == "mxfp8":  # the writer's range of scale bytes, and the extremes
        pages[:, :, -16:] = rng.choice([0, 1, 105, 127, 200, 247, 254, 255], (nb, S, 16))
    seq, glen, bt, rows, off = C.gather_case(rng, nb, S)
    want = np.full((4, rows, r.dims), 7.0, np.float32)
    V.dequantize_and_gather_k_cache(want, pages, seq, glen, bt, offset=off, layout=layout, **mx)
    base = torch.from_numpy(np.lib.stride_tricks.as_strided(pages, (nb * pages.strides[0],), (1,)).copy())
    tp = base.as_strided((nb, S, r.bytes), pages.strides)
    for backend in gather_backends(name):
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.full((4, rows, r.dims), 7.0, dtype=dtype)
            TV.dequantize_and_gather_k_cache(
                out,
                tp,
                torch.from_numpy(seq),
                torch.from_numpy(glen),
                torch.from_numpy(bt),
                offset=off,
                layout=layout,
                backend=backend,
                **mx,
            )
            w = want if dtype == torch.float32 else C.bf16(want)
            assert np.array_equal(out.float().numpy(), w, equal_nan=True), (backend, dtype)


def test_auto_and_named_backends():
    pages = torch.zeros((1, 4, 288), dtype=torch.uint8)
    assert TV.resolve_backend("auto", pages, "gather_records") == "reference"
    assert TV.resolve_backend("auto", pages, "insert_records") == "reference"
    with pytest.raises(BackendUnavailableError, match="backend='cpu' cannot run here: it has no 'insert_records'"):
        TV.insert_records(torch.zeros((1, 512)), pages, torch.tensor([0]), backend="cpu")
    with pytest.raises(BackendUnavailableError, match="it has no 'gather_records'"):
        TV.dequantize_and_gather_k_cache(
            torch.zeros((1, 4, 512)), pages, torch.tensor([4]), None, torch.tensor([[0]]), backend="cpu"
        )


Z = torch.zeros
BAD = [
    (
        lambda: TV.insert_records(Z((1, 512)), Z((1, 4, 530), dtype=torch.uint8), torch.tensor([0])),
        "k_cache: the last dim 530",
    ),
    (lambda: TV.insert_records(Z((1, 512)), Z((1, 4, 528)), torch.tensor([0])), "k_cache: expected uint8"),
    (
        lambda: TV.insert_records(Z((1, 512)).double(), Z((1, 4, 528), dtype=torch.uint8), torch.tensor([0])),
        "x: expected torch.float32",
    ),
    (
        lambda: TV.insert_records(Z((1, 512)), Z((1, 4, 528), dtype=torch.uint8), torch.tensor([4])),
        r"slot_mapping: slot_mapping\[0\] = 4",
    ),
    (
        lambda: TV.insert_records(Z((1, 512)), Z((1, 4, 528), dtype=torch.uint8), torch.tensor([0.0])),
        "slot_mapping: expected int64",
    ),
    (
        lambda: TV.quantize_and_insert_k_cache(Z((1, 512)), Z((1, 4, 528), dtype=torch.uint8), torch.tensor([0])),
        "k: expected torch.bfloat16",
    ),
    (
        lambda: TV.quantize_and_insert_k_cache(
            Z((1, 512), dtype=torch.bfloat16), Z((1, 4 * 528), dtype=torch.uint8), torch.tensor([0])
        ),
        "k_cache: 2-D pages",
    ),
    (
        lambda: TV.rope_quant_insert(
            Z((1, 512), dtype=torch.bfloat16),
            torch.tensor([3]),
            Z((2, 64)),
            Z((1, 4, 528), dtype=torch.uint8),
            torch.tensor([0]),
            1,
        ),
        r"positions: positions\[0\] = 3",
    ),
    (
        lambda: TV.rope_quant_insert(
            Z((1, 512), dtype=torch.bfloat16),
            torch.tensor([3]),
            Z((8, 64)),
            Z((1, 4, 132), dtype=torch.uint8),
            torch.tensor([0]),
            1,
        ),
        "kv_cache: holds index_fp8",
    ),
    (
        lambda: TV.indexer_k_norm_rope_store(
            Z((1, 128), dtype=torch.bfloat16),
            torch.tensor([0]),
            Z((8, 64)),
            Z(128),
            1e-6,
            Z((1, 4, 68), dtype=torch.uint8),
            torch.tensor([0]),
            1,
            False,
        ),
        "k_cache: holds index_mxfp4",
    ),
    (
        lambda: TV.indexer_k_norm_rope_store(
            Z((1, 128), dtype=torch.bfloat16),
            torch.tensor([0]),
            Z((8, 64)),
            Z(64),
            1e-6,
            Z((1, 4, 68), dtype=torch.uint8),
            torch.tensor([0]),
            1,
            True,
        ),
        r"rms_norm_weight: expected float32",
    ),
    (
        lambda: TV.dequantize_and_gather_k_cache(
            Z((1, 4, 512), dtype=torch.float16),
            Z((1, 4, 528), dtype=torch.uint8),
            torch.tensor([4]),
            None,
            torch.tensor([[0]]),
        ),
        "out: expected bfloat16 or float32",
    ),
    (
        lambda: TV.dequantize_and_gather_k_cache(
            Z((1, 4, 512)), Z((1, 4, 528), dtype=torch.uint8), torch.tensor([4]), None, torch.tensor([[2]])
        ),
        r"block_table: entry \[0, 0\] = 2",
    ),
    (
        lambda: TV.dequantize_and_gather_k_cache(
            Z((1, 4, 512)), Z((1, 4, 528), dtype=torch.uint8), torch.tensor([4]), None, torch.tensor([[0]]), layout="x"
        ),
        "layout: expected one of",
    ),
    (
        lambda: TV.dequantize_and_gather_k_cache(
            Z((1, 4, 512)), Z((1, 4, 528), dtype=torch.uint8), torch.tensor([4]), None, torch.tensor([[0]]), offset=-1
        ),
        "offset: expected an integer >= 0",
    ),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_inputs_are_named(i):
    call, match = BAD[i]
    with pytest.raises((ValueError, TypeError), match=match):
        call()
