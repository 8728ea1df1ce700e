"""Prefill level: whole steps (SWA, CSA and HCA layers) on every backend, plan and cache layout.

Every pair of backends agrees within the tolerance table, and the reference backends
(torch.reference, jax.xla) give the same bits under every plan (adaptive, fixed, per_request,
length order, a budget that splits requests) and cache layout (paged, logical) in fp32.
"""

import pytest
import torch

from tests.parity import backends as B
from tests.parity import cases as C
from tests.parity import harness as H

QUICK = {f"{c.name}-{c.dtype}": c for c in C.step_cases(quick=True)}
FULL = {f"{c.name}-{c.dtype}": c for c in C.step_cases() if f"{c.name}-{c.dtype}" not in QUICK and not c.splits}
# FlashMLA's own shape (H=64, D=512, bf16) is for the GPU; on CPU the quick bf16 classes cover bf16.
GPU_ONLY_HERE = {"flashmla-shape-bfloat16"}


def check(case: C.StepCase):
    rows = H.run_step_case(case)
    assert [r.name for r in rows] == [case.row(r) for r in case.layers]
    for row in rows:
        assert row.passed, "\n".join(row.failures())
        expected = {b.name for b in B.BACKENDS if B.why_not(b, case.dtype, case.head_dim, case.tiny) is None}
        assert row.ran == expected, (row.ran, expected)
        for name in ("torch.reference", "jax.xla"):
            if name in expected:
                # every plan and layout ran (the primary one is the base of the comparison)
                jax_skip = 0 if name == "torch.reference" else sum(v[1] not in case.jax_layouts for v in case.variants)
                extra = 1 if case.splits else 0
                assert len(row.invariance[name]) == len(case.variants) - 1 - jax_skip + extra, name
                assert (name in row.bitwise_required) == (case.dtype == "float32")
        if any(B.BY_NAME[b].framework == "jax" for b in row.ran):
            assert row.crossings > 0
    return rows


@pytest.mark.parametrize("name", list(QUICK))
def test_step(name):
    check(QUICK[name])


@pytest.mark.parametrize("name", list(FULL))
def test_larger_step(name):
    if name in GPU_ONLY_HERE and not torch.cuda.is_available():
        pytest.skip(B.GPU_ONLY)
    check(FULL[name])


def test_split_prompt_equals_one_step_bitwise():
    """Chunked prefill over six steps == one step, bit for bit on the reference backends."""
    case = next(c for c in C.step_cases() if c.splits)
    assert [b for _, b in case.splits][:-1] == [37, 128, 136, 211, 256]
    rows = check(case)
    for row in rows:
        for name in ("torch.reference", "jax.xla"):
            assert row.invariant(name).max_abs == 0.0
