"""Prefill level: whole steps (SWA, CSA and HCA layers) on every backend, plan and cache layout.

Every pair of backends agrees within the tolerance table, and the reference backends
(torch.reference, jax.xla, torch.cpu, jax.cpu) give the same bits under every plan (adaptive, fixed, per_request,
length order, a budget that splits requests) and cache layout (paged, logical) in fp32.

One test per case family: the cases of a family share shapes, so its JAX programs compile once
(compiling dominates on CPU; spreading a family over pytest-xdist workers would compile twice).
"""

import pytest

import planner as P
from tests.parity import backends as B
from tests.parity import cases as C
from tests.parity import harness as H

FAMILIES = {}
for _case in C.step_cases():
    if not _case.splits:  # the split prompt has its own test below
        FAMILIES.setdefault(_case.family, []).append(_case)


def check(case: C.StepCase):
    rows = H.run_step_case(case)
    assert [r.name for r in rows] == [case.row(r) for r in case.layers]
    failures = []
    for row in rows:
        failures += row.failures()
        expected = {b.name for b in B.BACKENDS if B.why_not(b, case.dtype, case.head_dim, case.tiny) is None}
        assert row.ran == expected and {"torch.reference", "jax.xla"} <= expected, (row.name, row.ran, expected)
        for name in [b.name for b in B.BACKENDS if b.reference and b.name in expected]:  # incl. the cpu backends
            # every plan and layout ran (the primary one is the base of the comparison)
            runs = [v for v in case.variants if B.BY_NAME[name].framework != "jax" or v[1] in case.jax_layouts]
            assert len(row.invariance.get(name, [])) == len(runs) - 1 + bool(case.splits), (row.name, name)
            assert (name in row.bitwise_required) == (case.dtype == "float32")
        if any(B.BY_NAME[b].framework == "jax" for b in row.ran):
            assert row.crossings > 0
    return rows, failures


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family(family):
    failures = []
    for case in FAMILIES[family]:
        failures += check(case)[1]
    assert not failures, "\n".join(failures)


def test_families_cover_the_issue():
    """Kinds, plans, query_len == 0 requests, model head counts and index widths, both dtypes."""
    assert "tiny-fp32" in FAMILIES  # the report's --quick family
    layers = {c.layer for cases in FAMILIES.values() for case in cases for c in case.layers.values()}
    assert layers == set(P.V4_LAYERS)  # every kind, at V4.0's ratios
    policies = {v[0] for cases in FAMILIES.values() for c in cases for v in c.variants}
    assert {"adaptive", "fixed", "per_request"} <= policies
    assert any(0 in c.first.query_lens for cases in FAMILIES.values() for c in cases)
    heads = {c.first.q.shape[1] for cases in FAMILIES.values() for c in cases}
    assert {64, 128} <= heads
    widths = {c.topk + c.first.window_size for cases in FAMILIES.values() for c in cases}
    assert {640, 1152} <= widths
    assert {c.dtype for cases in FAMILIES.values() for c in cases} == {"float32", "bfloat16"}


def test_split_prompt_equals_one_step_bitwise():
    """Chunked prefill over six steps == one step: bit for bit on the reference backends."""
    (case,) = [c for c in C.step_cases() if c.splits]
    assert [b for _, b in case.splits][:-1] == [37, 128, 136, 211, 256]
    rows, failures = check(case)
    assert not failures, "\n".join(failures)
    for row in rows:
        for name in [b.name for b in B.BACKENDS if b.reference and b.name in row.ran]:
            assert row.invariant(name).max_abs == 0.0
