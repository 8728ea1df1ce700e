"""Torch and JAX see the very same inputs: tensors cross by DLPack, bit for bit (bf16 and NaN included)."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tests.parity import backends as B
from tests.parity import cases as C
from tests.parity import harness as H


def test_kernel_inputs_cross_bitwise_fp32_and_bf16():
    for dtype in ("float32", "bfloat16"):
        case = next(c for c in C.kernel_cases(dtypes=(dtype,)) if c.klass == "NaN in unreferenced kv rows")
        x = H.kernel_inputs(case)
        j = x.crossed()
        assert j["q"].dtype == jnp.dtype(dtype) and j["indices"].dtype == jnp.int32
        assert H.check_crossing(x) == 5  # q, kv, indices, sink, topk_length
        assert np.isnan(np.asarray(j["kv"], np.float32)).any()  # the NaN rows crossed as NaN


def test_same_bits_sees_a_flipped_bit():
    t = torch.linspace(-1, 1, 64).bfloat16()
    j = B.to_jax(t)
    assert B.same_bits(t, j)
    flipped = t.clone()
    flipped.view(torch.int16)[5] ^= 1
    assert not B.same_bits(flipped, j)


def test_prefill_inputs_cross_bitwise():
    case = next(c for c in C.step_cases() if c.dtype == "bfloat16" and c.family == "tiny-bf16")
    layers = H.step_inputs(case)
    n = H.check_step_crossing(layers, padded=64)
    # per layer: q, sink, top-k rows (CSA), and rows/offsets/pages/block table of each cache
    assert n == sum(2 + (x.topk is not None) + 4 * (1 + (x.comp is not None)) for x in layers.values())


def test_outputs_cross_back_and_probe():
    probe = B.crossing_probe()
    assert all(v["to_jax_bitwise"] and v["round_trip_bitwise"] for v in probe.values()), probe
    out = jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4) / 7
    back = torch.from_dlpack(out)
    assert back.dtype == torch.bfloat16
    np.testing.assert_array_equal(B.to_numpy(out), np.asarray(out, np.float64))
    assert B.to_numpy(jax.numpy.zeros((0, 3))).shape == (0, 3)
