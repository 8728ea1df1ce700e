"""Prefill level, DeepSeek-V4.1: every layer of the tiny schedule on every backend, plan and cache
layout (paged, logical, 528-byte mxfp8 pages), against the float64 oracle's layer_attention; one
row per (case class, plan key, dtype). The reference backends (torch.reference, jax.xla,
torch.cpu, jax.cpu) give the same bits under every plan and layout in fp32."""

import pytest

from tests.parity import backends as B
from tests.parity import v41 as V

CASES = {c.klass: c for c in V.v41_step_cases()}


def check(sc: V.V41StepCase):
    rows = V.run_v41_case(sc)
    st = sc.case.step()
    assert [r.name for r in rows] == [sc.row(k) for k in st.plans]
    failures = []
    for row, key in zip(rows, st.plans):
        failures += row.failures()
        expected = {b.name for b in B.BACKENDS if B.why_not(b, sc.dtype, sc.head_dim, sc.tiny) is None}
        assert row.ran == expected - set(row.not_run), (row.name, row.ran, expected)
        assert {"oracle", "torch.reference", "torch.cpu", "jax.xla", "jax.cpu"} <= row.ran, row.name
        for name in ("torch.reference", "torch.cpu", "jax.xla", "jax.cpu"):
            # every plan and layout ran, for every layer reading this plan
            assert len(row.invariance[name]) == (len(sc.variants) - 1) * len(st.sharing[key]), (row.name, name)
            assert (name in row.bitwise_required) == (sc.dtype == "float32")
    return rows, failures


@pytest.mark.parametrize("klass", list(CASES))
def test_v41_case(klass):
    sc = CASES[klass]
    rows, failures = check(sc)
    assert not failures, "\n".join(failures)
    if sc.dtype == "float32":
        for row in rows:
            for name in ("torch.reference", "torch.cpu", "jax.xla", "jax.cpu"):
                assert row.invariant(name).max_abs == 0.0, (row.name, name)


def test_cases_cover_ratios_bands_and_layouts():
    keys = {k for sc in CASES.values() for k in sc.case.step().plans}
    assert {(k.compress_ratio, k.band) for k in keys} == {
        (0, "full"),
        (2, "full"),
        (1, "full"),
        (1, "cut"),
        (1, "replay"),
    }
    assert {v[1] for sc in CASES.values() for v in sc.variants} == {"paged", "logical", "mxfp8"}
    assert any(sc.case.batch.replay_start is not None and sc.case.batch.replay_start.any() for sc in CASES.values())
    assert any(0 in sc.case.batch.query_lens for sc in CASES.values())
