"""Our fp8_ds_mla cache functions against vLLM 0.33.0's own, run here: bytes written and values read.

vLLM's `quantize_and_insert_k_cache` and `dequantize_and_gather_k_cache` (its Triton kernels, in
Triton's interpreter on CPU tensors; the gather's CuteDSL branch bypassed, it compiles for GPUs
only) against `planner.kvcache` (the NumPy reference) and `dsv4_torch.kvcache` (every backend
that runs here: the C kernel, the torch path). The interpreter rounds float32 -> e4m3 wrongly
when rounding carries into the exponent and decodes NaN codes and subnormals wrongly
(real-formats.md section 1), so the tokens are exactly representable after scaling (no rounding)
and the pages hold no NaN or subnormal codes: what is compared is the layout, the exponent rule,
the scale bytes and the addressing, where the two implementations could really disagree.
"""

import numpy as np
import pytest
import torch

from planner import kvcache as P


def representable_tokens(rng, T):
    """bf16 tokens whose groups quantize without rounding: e4m3 normal values (|v| >= 2^-6,
    so no subnormal codes) times 2^s per group, one element per group at +-448 (so the
    exponent is exactly s)."""
    mant = rng.integers(0, 8, (T, 7, 64))
    expo = rng.integers(1, 16, (T, 7, 64))  # e4m3 exponent field 1..15 (15 with mantissa < 7)
    mant = np.where(expo == 15, np.minimum(mant, 6), mant)
    v = (1 + mant / 8) * 2.0 ** (expo - 7) * rng.choice([-1, 1], (T, 7, 64))
    v[:, :, 0] = 448.0 * rng.choice([-1, 1], (T, 7))
    s = rng.integers(-20, 20, (T, 7, 1))
    nope = (v * 2.0**s).reshape(T, 448)
    rope = rng.standard_normal((T, 64)) * 3
    k = np.concatenate([nope, rope], axis=1).astype(np.float32)
    return torch.from_numpy(k).bfloat16()


@pytest.fixture(scope="module")
def cache_utils(vllm_plugins):
    from vllm.models.deepseek_v4.common.ops import cache_utils as module

    mp = pytest.MonkeyPatch()
    mp.setattr(module, "has_cutedsl", lambda: False)
    yield module
    mp.undo()


@pytest.mark.parametrize("S", [64, 2])
def test_writer_bytes_equal_vllms(cache_utils, S):
    from dsv4_torch import kvcache as TK

    rng = np.random.default_rng(S)
    nb, T = 5, 3 * S + 1 if S > 2 else 9
    k = representable_tokens(rng, T)
    slots = torch.from_numpy(rng.permutation(nb * S)[:T].astype(np.int64))
    slots[1] = -1
    start = rng.integers(0, 256, (nb, P.page_bytes(S)), dtype=np.uint8)
    theirs = torch.from_numpy(start.copy())
    cache_utils.quantize_and_insert_k_cache(k, theirs, slots, block_size=S)
    ours = start.copy()
    P.quantize_and_insert_k_cache(k.float().numpy(), ours, slots.numpy(), S)
    assert np.array_equal(theirs.numpy(), ours)
    mine = torch.from_numpy(start.copy())
    TK.quantize_and_insert_k_cache(k, mine, slots, S)
    assert np.array_equal(mine.numpy(), ours)


@pytest.mark.parametrize("S", [64, 2])
def test_reader_values_equal_vllms(cache_utils, S):
    from dsv4_torch import kvcache as TK

    rng = np.random.default_rng(10 + S)
    nb = 6
    pages = np.zeros((nb, P.page_bytes(S)), np.uint8)
    P.quantize_and_insert_k_cache(representable_tokens(rng, nb * S).float().numpy(), pages, np.arange(nb * S), S)
    seq = torch.tensor([nb * S, 5, 3 * S + 1], dtype=torch.int32)
    gather = torch.tensor([nb * S - 3, 5, S + 1], dtype=torch.int32)
    table = torch.from_numpy(np.stack([rng.permutation(nb) for _ in range(3)]).astype(np.int32))
    view = torch.from_numpy(pages).as_strided((nb, S, P.SLOT_BYTES), (P.page_bytes(S), P.SLOT_BYTES, 1))  # vLLM's view
    shape = (3, nb * S + 4, 512)
    for gl, offset in ((gather, 2), (None, 0)):
        theirs = torch.full(shape, 3.0, dtype=torch.bfloat16)
        cache_utils.dequantize_and_gather_k_cache(theirs, view, seq, gl, table, S, offset)
        backends = ["reference"] + (["cpu"] if TK.cpu_unavailable_reason() is None else [])
        for backend in backends:
            ours = torch.full(shape, 3.0, dtype=torch.bfloat16)
            TK.dequantize_and_gather_k_cache(ours, view, seq, gl, table, S, offset, backend=backend)
            assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), (backend, offset)
