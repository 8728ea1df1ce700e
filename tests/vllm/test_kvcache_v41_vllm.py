"""Our DeepSeek-V4.1 cache records against vLLM 0.33.0's own writers and gathers, run here: bytes.

vLLM's Triton kernels (`vllm/models/deepseek_v41/common/ops/`: `quantize_and_insert_k_cache(...,
bytes_per_token=528)`, `rope_quant_insert` on 528-byte pages, `indexer_k_norm_rope_store` with
FP8 keys (float32 scales, and SM100's four UE8M0 bytes), `dequantize_and_gather_k_cache` on 528- and 288-byte pages) in Triton's interpreter on
CPU tensors, against `planner.kvcache_v41` (the NumPy reference) and `dsv4_torch.kvcache_v41`
(every backend that runs here). vLLM writes these KV records interleaved (each record's scales
after its data) and the index keys split (all data, then all scales): the default layouts.

The interpreter casts float32 -> e4m3 wrongly when rounding carries into the exponent and
decodes NaN and subnormal e4m3 codes wrongly (real-formats.md section 1), so the inputs quantize
without rounding (e4m3 normal values times a power of two per group, RoPE by quarter turns, an
RMSNorm whose sum of squares is a power of 4 with eps 0) and the gathered pages hold no NaN or
subnormal codes: what is compared is the layout, the exponent rules, the scale bytes, the RoPE
pairing and position, and the addressing. vLLM's NVFP4 and MXFP4 writers use inline PTX (no
interpreter): those records are checked against the format in tests/planner/test_kvcache_v41.py.
"""

import numpy as np
import pytest
import torch

from dsv4_torch import kvcache_v41 as TV
from planner import kvcache_v41 as V

E4M3_NORMAL = np.array([(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8) if (1 + m / 8) * 2.0**e <= 448])


def representable(rng, T, dims=512, group=32):
    """bf16 rows whose groups quantize without rounding: e4m3 normal values times 2^s per group,
    one element per group at +-448 * 2^s (the exponent is exactly s)."""
    G = dims // group
    v = rng.choice(E4M3_NORMAL[E4M3_NORMAL >= 2.0**-4], (T, G, group)) * rng.choice([-1, 1], (T, G, group))
    v[np.arange(T)[:, None], np.arange(G), rng.integers(0, group, (T, G))] = 448.0 * rng.choice([-1, 1], (T, G))
    x = (v * 2.0 ** rng.integers(-20, 20, (T, G, 1))).reshape(T, dims).astype(np.float32)
    return torch.from_numpy(x).bfloat16()


def quarter_turns(rng, max_pos):
    """cos_sin_cache [max_pos, 64] float32 with (cos, sin) in {(1, 0), (0, 1), (-1, 0), (0, -1)}."""
    k = rng.integers(0, 4, (max_pos, 32))
    cos = np.choose(k, [1.0, 0.0, -1.0, 0.0]).astype(np.float32)
    sin = np.choose(k, [0.0, 1.0, 0.0, -1.0]).astype(np.float32)
    return torch.from_numpy(np.concatenate([cos, sin], axis=1))


@pytest.fixture(scope="module")
def ops(vllm_plugins):
    from vllm.models.deepseek_v41.common.ops import cache_utils, fused_compress_quant_cache, indexer_k_store

    mp = pytest.MonkeyPatch()
    mp.setattr(cache_utils, "has_cutedsl", lambda: False)  # its CuteDSL gather compiles for GPUs only
    yield cache_utils, fused_compress_quant_cache, indexer_k_store
    mp.undo()


def start_pages(rng, nb, S, W):
    return torch.from_numpy(rng.integers(0, 256, (nb, S, W), dtype=np.uint8))


@pytest.mark.parametrize("S", [32, 3])
def test_plain_writer_bytes_equal_vllms(ops, S):
    cache_utils = ops[0]
    rng = np.random.default_rng(S)
    nb, T = 4, 2 * S + 1
    k = representable(rng, T)
    slots = torch.from_numpy(rng.permutation(nb * S)[:T].astype(np.int64))
    slots[1] = -1
    start = start_pages(rng, nb, S, 528)
    theirs = start.clone().view(nb, S * 528)  # vLLM's writer takes [num_blocks, block_bytes]
    cache_utils.quantize_and_insert_k_cache(k, theirs, slots, block_size=S, bytes_per_token=528)
    ours = start.numpy().copy()
    V.quantize_and_insert_k_cache(k.float().numpy(), ours, slots.numpy())
    assert np.array_equal(theirs.view(nb, S, 528).numpy(), ours)
    mine = start.clone()
    TV.quantize_and_insert_k_cache(k, mine, slots)
    assert np.array_equal(mine.numpy(), ours)


@pytest.mark.parametrize("ratio", [1, 2])
def test_rope_quant_insert_bytes_equal_vllms(ops, ratio):
    fused = ops[1]
    rng = np.random.default_rng(10 + ratio)
    nb, S, T, max_pos = 3, 32, 40, 96
    latent = representable(rng, T)
    positions = torch.from_numpy(rng.integers(0, max_pos, T).astype(np.int64))
    cs = quarter_turns(rng, max_pos)
    slots = torch.from_numpy(rng.permutation(nb * S)[:T].astype(np.int64))
    slots[2] = -1
    start = start_pages(rng, nb, S, 528)
    theirs = start.clone()
    fused.rope_quant_insert(latent, positions, cs, theirs, slots, ratio)
    ours = start.numpy().copy()
    V.rope_quant_insert(latent.float().numpy(), positions.numpy(), cs.numpy(), ours, slots.numpy(), ratio)
    assert np.array_equal(theirs.numpy(), ours)
    assert not np.array_equal(ours, start.numpy())
    mine = start.clone()
    TV.rope_quant_insert(latent, positions, cs, mine, slots, ratio)
    assert np.array_equal(mine.numpy(), ours)


def exact_norm_keys(rng, T):
    """k_pre [T, 128] bf16 with sum(k^2) / 128 = 4^(a + 1) (80 entries +-2^a, 48 entries +-3 * 2^a)
    and a weight w for which k * 2^-(a+1) * w has at most 4 significant bits: the norm is exact."""
    mag = np.zeros((T, 128))
    for t in range(T):
        mag[t, rng.permutation(128)[:48]] = 3.0
    mag[mag == 0] = 1.0
    k = mag * rng.choice([-1, 1], (T, 128)) * 2.0 ** rng.integers(-6, 6, (T, 1))
    w = rng.choice([1.0, 1.25, 1.5, 1.75], 128) * 2.0 ** rng.integers(-2, 3, 128)
    w[mag[0] == 3.0] = rng.choice([1.0, 1.25], int((mag[0] == 3.0).sum())) * 2.0 ** rng.integers(
        -2, 3, int((mag[0] == 3.0).sum())
    )
    return torch.from_numpy(k.astype(np.float32)).bfloat16(), torch.from_numpy(w.astype(np.float32)), mag


@pytest.mark.parametrize("ratio, mx", [(1, False), (2, False), (2, True)])
def test_index_key_writer_bytes_equal_vllms(ops, ratio, mx, monkeypatch):
    """mx: the scale as four UE8M0 bytes, what vLLM writes on SM100 (`mqa_logits_use_mx_scales`)."""
    store = ops[2]
    monkeypatch.setattr(store, "mqa_logits_use_mx_scales", lambda: mx)
    rng = np.random.default_rng(20 + ratio)
    nb, S, T, max_pos = 3, 64, 24, 80
    k_pre, w, mag = exact_norm_keys(rng, 1)
    k_pre = k_pre.repeat(T, 1) * torch.from_numpy(2.0 ** rng.integers(-3, 3, (T, 1))).bfloat16()
    positions = torch.from_numpy(rng.integers(0, max_pos, T).astype(np.int64))
    cs = quarter_turns(rng, max_pos)
    slots = torch.from_numpy(rng.permutation(nb * S)[:T].astype(np.int64))
    slots[0] = -1
    start = start_pages(rng, nb, S, 132)
    theirs = start.clone()
    store.indexer_k_norm_rope_store(k_pre, positions, cs, w, 0.0, theirs, slots, ratio, False)
    ours = start.numpy().copy()
    V.indexer_k_norm_rope_store(
        k_pre.float().numpy(),
        positions.numpy(),
        cs.numpy(),
        w.numpy(),
        0.0,
        ours,
        slots.numpy(),
        ratio,
        False,
        mx_scales=mx,
    )
    assert np.array_equal(theirs.numpy(), ours)
    mine = start.clone()
    TV.indexer_k_norm_rope_store(k_pre, positions, cs, w, 0.0, mine, slots, ratio, False, mx_scales=mx)
    assert np.array_equal(mine.numpy(), ours)


def clean_pages(rng, nb, S, W):
    """Pages of one record kind with no NaN and no subnormal e4m3 codes (data or nvfp4 scales)."""
    r = V.BY_BYTES[W]
    pages = np.zeros((nb, S, W), np.uint8)
    if r.name == "mxfp8":
        x = representable(rng, nb * S).float().numpy()
    else:
        x = (rng.standard_normal((nb * S, 512)) * 2.0 ** rng.integers(-4, 8, (nb * S, 1))).astype(np.float32)
    V.insert_records(x, pages, np.arange(nb * S))
    return pages


@pytest.mark.parametrize("W", [528, 288])
def test_gather_values_equal_vllms(ops, W):
    cache_utils = ops[0]
    rng = np.random.default_rng(W)
    nb, S = 5, 32
    pages = clean_pages(rng, nb, S, W)
    view = torch.from_numpy(pages)
    seq = torch.tensor([nb * S, 7, 2 * S + 3], dtype=torch.int32)
    gather = torch.tensor([nb * S - 5, 7, S + 1], dtype=torch.int32)
    table = torch.from_numpy(np.stack([rng.permutation(nb) for _ in range(3)]).astype(np.int32))
    shape = (3, nb * S + 4, 512)
    for gl, offset in ((gather, 3), (None, 0)):
        theirs = torch.full(shape, 3.0, dtype=torch.bfloat16)
        cache_utils.dequantize_and_gather_k_cache(theirs, view, seq, gl, table, S, offset)
        ref = np.full(shape, 3.0, np.float32)
        V.dequantize_and_gather_k_cache(
            ref, pages, seq.numpy(), None if gl is None else gl.numpy(), table.numpy(), S, offset
        )
        assert np.array_equal(theirs.float().numpy(), ref), offset
        backends = ["reference"] + (
            ["cpu"] if W == 528 and TV.resolve_backend("auto", view, "gather_mxfp8") == "cpu" else []
        )
        for backend in backends:
            ours = torch.full(shape, 3.0, dtype=torch.bfloat16)
            TV.dequantize_and_gather_k_cache(ours, view, seq, gl, table, S, offset, backend=backend)
            assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), (backend, offset)


def test_nvfp4_and_mxfp4_writers_need_a_gpu(ops):
    """vLLM's FP4 writers pack with inline PTX, which Triton's interpreter refuses: why those two
    records are compared with the NumPy reference written from the format instead."""
    fused, store = ops[1], ops[2]
    lat = torch.ones((1, 512), dtype=torch.bfloat16)
    with pytest.raises(Exception, match="inline_asm not supported in interpreter mode"):
        fused.rope_quant_insert(
            lat,
            torch.tensor([0]),
            torch.ones((4, 64)),
            torch.zeros((1, 4, 288), dtype=torch.uint8),
            torch.tensor([0]),
            1,
        )
    with pytest.raises(Exception, match="inline_asm not supported in interpreter mode"):
        store.indexer_k_norm_rope_store(
            torch.ones((1, 128), dtype=torch.bfloat16),
            torch.tensor([0]),
            torch.ones((4, 64)),
            torch.ones(128),
            1e-6,
            torch.zeros((1, 4, 68), dtype=torch.uint8),
            torch.tensor([0]),
            1,
            True,
        )
