"""The GPU check scripts run end to end on CPU in their dry-run modes (tiny shapes, the reference
backends and the Triton/Pallas interpreters), so a GPU lease is never spent on a script error.
They run as the device machine runs them: `python -m bench.NAME` from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("torch")
pytest.importorskip("jax")


def _run(args, env_extra=None, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    return text


def test_torch_kernel_check_dry_run():
    pytest.importorskip("triton")
    text = _run(["-m", "bench.checks.gpu_torch", "--dry-run", "--sweep-seconds", "1"])
    assert "[error in" not in text and "FAIL" not in text and "Traceback" not in text, text[-4000:]
    assert text.count("PASS") >= 3  # the real shapes, Triton (interpreted) against the reference
    assert "TFLOPS" in text


def test_jax_kernel_check_dry_run():
    text = _run(["-m", "bench.checks.gpu_jax", "--budget", "3000"], {"DSV4_GPU_CHECK_DRY_RUN": "1"})
    assert "FAILED" not in text and "Traceback" not in text, text[-4000:]
    assert "triton vs xla: PASS" in text and "vs float64 oracle on 6 tokens: PASS" in text, text[-4000:]
    # the Mosaic kernel runs (interpreted, jax >= 0.12) and agrees, or says why it cannot
    assert text.count("mosaic vs xla on 1 tokens: PASS") + text.count("mosaic not run: ") == 2, text[-4000:]


def test_prefill_check_dry_run():
    text = _run(["-m", "bench.checks.gpu_prefill", "--dry-run", "--iters", "1", "--workloads", "spec-example"])
    assert "Traceback" not in text, text[-4000:]
    rows = [line for line in text.splitlines() if line.startswith("spec-example")]
    assert len(rows) >= 2 * 2 * 3 * 3, text[-4000:]  # all rows, printed twice: as measured and at the end
    assert all(line.rstrip().endswith("yes") for line in rows), "plans must give bitwise equal outputs"


def test_gpu_check_runs_its_modules(tmp_path):
    """Without a GPU each check says so and exits 0: `bench.gpu_check` finds, starts and logs all
    six modules (a wrong module name or import exits non-zero here)."""
    import jax
    import torch

    if torch.cuda.is_available() or jax.default_backend() != "cpu":
        pytest.skip("a GPU is visible: bench.gpu_check would run the real checks (minutes)")
    text = _run(["-m", "bench.gpu_check", "--budget", "270"], {"OUT": str(tmp_path)})
    for module in ("gpu_torch", "gpu_jax", "gpu_prefill", "gpu_model", "gpu_kvcache", "gpu_v41"):
        assert f"##### bench.checks.{module}: exit 0," in text, text[-4000:]
        assert (tmp_path / f"{module}.log").read_text().strip(), module
    assert "Traceback" not in text, text[-4000:]
    # the suite's GPU tests: found by their marker, collected, skipped here with the reason
    assert "##### pytest: exit 0," in text, text[-4000:]
    log = (tmp_path / "pytest.log").read_text()
    assert "test_flashmla_matches_oracle" in log and "SKIPPED" in log and "needs an SM90/SM100 GPU" in log, log[-3000:]
    assert "passed" not in log.splitlines()[-1] and "skipped" in log.splitlines()[-1], log[-3000:]


def test_model_check_dry_run():
    """bench.checks.gpu_model: one layer written in the official format, loaded, two prefill steps."""
    text = _run(["-m", "bench.checks.gpu_model", "--dry-run"])
    assert "Traceback" not in text and "FAILED" not in text, text[-4000:]
    assert "logits finite: True" in text and "tokens/s" in text and "on the device" in text, text[-4000:]


def test_v41_check_dry_run():
    """bench.checks.gpu_v41: a V4.1 step with replay (4 plans) and without (3), every chunk through
    our Triton kernel (interpreted) against the reference, the SM100 / vLLM kernels' reasons."""
    pytest.importorskip("triton")
    text = _run(["-m", "bench.checks.gpu_v41", "--dry-run"])
    assert "Traceback" not in text and "FAIL" not in text, text[-4000:]
    assert "replay on: 4 plans" in text and "replay off: 3 plans" in text, text[-4000:]
    assert "CSA1/replay" in text and "CSA1/cut" in text and "CSA2/full" in text, text[-4000:]
    assert "needs an sm_10x GPU" in text and "V4.1 plans through the kernels: PASS (7 rows)" in text, text[-4000:]
