"""External reference: transformers' DeepSeek-V4 eager attention == our prefill path on its own inputs.

A tiny random float64 checkpoint; one SWA, one CSA and one HCA layer; a single 299-token call and
the same prompt as a chunked prefill (calls 0:37, 37:211, 211:299 and a decode step) whose calls
read the history earlier calls appended to our cache. See tests/parity/hf_reference.py.

One test: the capture is one forward pass for all layers (a fixture would run once per
pytest-xdist worker).
"""

import pytest

pytest.importorskip("transformers")

from tests.parity import backends as B  # noqa: E402
from tests.parity import hf_reference as HF  # noqa: E402


def test_prefill_equals_transformers_eager():
    calls = HF.capture_calls()
    assert [len(v) for v in calls["CSA"].values()] == [1, len(HF.CHUNKS)]
    rows = {r.name: r for r in HF.run_hf(calls)}
    assert len(rows) == len(HF.LAYERS) * 2 * len(HF.DTYPES)
    failures = [f for r in rows.values() for f in r.failures()]
    assert not failures, "\n".join(failures)
    for kind in HF.LAYERS:
        for calls_name in ("single call", "chunked prefill"):
            for dtype in ("fp64", "fp32"):
                row = rows[f"{kind} · {calls_name} · {dtype}"]
                expected = {"oracle", "torch.reference"} | ({"jax.xla"} if dtype == "fp32" else set())
                assert expected <= row.ran, (row.name, row.ran)
                for name in expected:
                    cell = row.cell(HF.TRUTH, name)
                    assert cell.max_rel <= (1e-12 if dtype == "fp64" else 1e-5), (row.name, name, cell)
                if dtype == "fp64":  # plans give the same bits
                    assert row.invariant("torch.reference").max_abs == 0
                for name, reasons in row.not_run.items():
                    assert reasons and name in B.BY_NAME
