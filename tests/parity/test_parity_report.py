"""The report command: table, JSON, exit status."""

import json

import numpy as np

from tests.parity import harness as H
from tests.parity import report as R
from tests.parity.tolerances import Agreement, compare_out, compare_stat


def test_report_runs_a_class_and_writes_json(tmp_path, capsys):
    out = tmp_path / "parity.json"
    code = R.main(["--levels", "kernel", "--match", "duplicated indices · fp32", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    rep = json.loads(out.read_text())
    (row,) = rep["levels"]["kernel"]
    assert row["name"] == "duplicated indices · fp32" and row["passed"]
    pairs = {(p["a"], p["b"]) for p in row["pairs"]}
    assert ("oracle", "torch.reference") in pairs and ("torch.reference", "jax.xla") in pairs
    for name, st in rep["backends"].items():
        if not st["available"]:
            assert st["reason"] in text and name in row["not_run"]
    assert "duplicated indices · fp32" in text and "oracle:t.ref" in text and "all rows passed" in text
    assert rep["dlpack"]["tensors_checked_bitwise"] > 0 and rep["summary"]["passed"]


def test_failing_row_is_flagged(capsys):
    row = H.Row("kernel", "made up · fp32", ["x"])
    row.add_pair("oracle", "jax.xla", Agreement(1e-3, 1e-3, False, "max_rel 0.001 > 1e-05"))
    row.add_pair("oracle", "torch.reference", Agreement(1e-7, 1e-7, True))
    rep = R.to_json([row], 1.0)
    assert not rep["summary"]["passed"] and rep["summary"]["failed_rows"] == 1
    text = R.format_report(rep)
    assert "made up · fp32  << FAIL" in text and "1.0e-3/1.0e-3 FAIL" in text and "1.0e-7/1.0e-7 ok" in text


def test_tolerance_rules():
    ref = np.linspace(-1, 1, 100)
    assert compare_out(ref, ref + 5e-6, ref, "float32").passed
    assert not compare_out(ref, ref + 2e-5, ref, "float32").passed
    few = ref.copy()
    few[[10, 70]] *= 1 + 2e-2  # two elements 2% off: within 3/128, cosine diff 4e-6
    assert compare_out(ref, few, ref, "bfloat16").passed
    assert not compare_out(ref, ref + 2e-3, ref, "bfloat16").passed  # near 0: over 8e-4 and 3/128
    scaled = compare_out(ref, ref * (1 + 2e-2), ref, "bfloat16")  # every element 2% off: cosine diff 2e-4
    assert not scaled.passed and "cosine" in scaled.detail
    bad = ref.copy()
    bad[3] = np.nan
    assert not compare_out(ref, bad, ref, "float32").passed
    inf = np.array([np.inf, 1.0])
    assert compare_stat(inf, inf, inf, "float32", "lse").passed
    assert not compare_stat(np.array([1.0, 1.0]), inf, inf, "float32", "lse").passed
