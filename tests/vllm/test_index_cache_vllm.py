"""Our index key cache bytes against vLLM 0.33.0's own Triton writer (`indexer_k_quant_and_cache_triton`),
run in Triton's interpreter on CPU tensors.

That writer lays a page out as the V4 compressor's fused writer does (values of every slot, then
a float32 UE8M0 scale per slot) when block_size is 1 (larger blocks take ROCm's tiled layout). The
keys are exactly representable (e4m3 grid values times a power of two, amax = 448 * 2^j): Triton's
interpreter casts to fp8 wrongly when rounding carries into the exponent (docs/real-formats.md),
so only inputs that need no rounding compare the layout and the scale rule, not that bug.
"""

import ml_dtypes
import numpy as np
import torch

from dsv4_torch import index_cache as tic
from planner import index_cache as ic


def test_bytes_equal_vllms_triton_writer(vllm_plugins):
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import indexer_k_quant_and_cache_triton

    rng = np.random.default_rng(0)
    T, D = 48, 128
    grid = ml_dtypes.float8_e4m3fn
    k = rng.uniform(-448, 448, (T, D)).astype(grid).astype(np.float32)
    k[:, 0] = 448.0 * np.where(rng.random(T) < 0.5, 1, -1)
    k *= np.ldexp(1.0, rng.integers(-20, 10, T))[:, None].astype(np.float32)
    slots = rng.permutation(80)[:T]
    theirs = torch.zeros((80, 1, D + 4), dtype=torch.uint8)
    indexer_k_quant_and_cache_triton(torch.from_numpy(k).bfloat16(), theirs, torch.from_numpy(slots).long(), D, "ue8m0")
    ours = np.zeros((80, 1, D + 4), np.uint8)
    ic.indexer_k_quant_and_cache(k, ours, slots, D)
    assert np.array_equal(theirs.numpy(), ours)
    mine = torch.zeros((80, 1, D + 4), dtype=torch.uint8)
    tic.indexer_k_quant_and_cache(torch.from_numpy(k), mine, torch.from_numpy(slots), D)
    assert torch.equal(mine, theirs)
