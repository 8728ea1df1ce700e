"""bench.checks.gpu_kvcache runs end to end on CPU in its dry-run mode (tiny shapes, the Triton
interpreter and Pallas interpret mode), so a GPU lease is never spent on a script error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("triton")


def test_kvcache_check_dry_run():
    # (a budget no loaded CI box reaches: the test checks that every section runs, not its time)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run(
        [sys.executable, "-m", "bench.checks.gpu_kvcache", "--dry-run", "--iters", "1", "--budget", "3000"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    assert "[error in" not in text and "FAIL" not in text and "Traceback" not in text, text[-4000:]
    # 3 torch + 12 jax correctness rows (writer, written pages, random bytes; S = 64 and 2)
    assert text.count(": PASS") == 18, text[-4000:]
    assert "GB/s read" in text and "vs copy" in text
    # prefill layers on fp8 vs bf16 pages, three kinds in each framework, bitwise equal outputs
    assert text.count("PASS bitwise equal") == 6, text[-4000:]
