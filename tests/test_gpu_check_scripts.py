"""The GPU check scripts run end to end on CPU in their dry-run modes (tiny shapes, the reference
backends and the Triton/Pallas interpreters), so a GPU lease is never spent on a script error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    text = _run(["bench/gpu_check_torch.py", "--dry-run", "--sweep-seconds", "1"])
    assert "[error in" not in text and "FAIL" not in text and "Traceback" not in text, text[-4000:]
    assert text.count("PASS") >= 3  # the real shapes, Triton (interpreted) against the reference
    assert "TFLOPS" in text


def test_jax_kernel_check_dry_run():
    text = _run(["bench/gpu_check_jax.py", "--budget", "60"], {"DSV4_GPU_CHECK_DRY_RUN": "1"})
    assert "FAILED" not in text and "Traceback" not in text, text[-4000:]
    assert "pallas_triton vs xla: PASS" in text and "vs float64 oracle on 6 tokens: PASS" in text, text[-4000:]


def test_prefill_check_dry_run():
    text = _run(["bench/gpu_check_prefill.py", "--dry-run", "--iters", "1", "--workloads", "spec-example"])
    assert "Traceback" not in text, text[-4000:]
    rows = [line for line in text.splitlines() if line.startswith("spec-example")]
    assert len(rows) >= 2 * 2 * 3 * 3, text[-4000:]  # all rows, printed twice: as measured and at the end
    assert all(line.rstrip().endswith("yes") for line in rows), "plans must give bitwise equal outputs"


def test_model_check_dry_run():
    """bench/gpu_check_model.py: one layer written in the official format, loaded, two prefill steps."""
    text = _run(["bench/gpu_check_model.py", "--dry-run"])
    assert "Traceback" not in text and "FAILED" not in text, text[-4000:]
    assert "logits finite: True" in text and "tokens/s" in text and "on the device" in text, text[-4000:]
