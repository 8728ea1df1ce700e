"""`make test-vllm-cpu` / `make bench-vllm-cpu` stop at once, before building any venv, on a CPU
without AVX512-BF16 or AMX, with one line naming what is missing and what still works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.vllm_cpu_hardware import refusal

ROOT = Path(__file__).resolve().parents[2]
LACKING = "fpu sse2 avx avx2 fma avx512f avx512bw"  # AVX-512 without BF16: vLLM's library still refuses


@pytest.mark.parametrize(
    "flags, ok", [(LACKING, False), ("avx2 fma", False), ("avx2 avx512f avx512_bf16", True), ("avx2 amx_bf16", True)]
)
def test_the_check_names_what_is_missing(flags, ok):
    done = subprocess.run(
        [sys.executable, "tools/vllm_cpu_hardware.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, DSV4_VLLM_CPU_FLAGS=flags),
    )
    assert (done.returncode == 0) is ok, done
    if ok:
        assert done.stderr == "" and done.stdout == ""
    else:
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "neither AVX512-BF16 nor AMX" in lines[0] and "make test" in lines[0]
        assert lines[0] == refusal(set(flags.split()))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make (the Makefile's targets are what is tested)")
@pytest.mark.parametrize("target", ["test-vllm-cpu", "bench-vllm-cpu"])
def test_make_targets_stop_before_building_a_venv(tmp_path, target):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "vllm_cpu_hardware.py", tmp_path / "tools")
    done = subprocess.run(
        ["make", "--no-print-directory", target],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, DSV4_VLLM_CPU_FLAGS=LACKING),
    )
    assert done.returncode != 0
    assert "neither AVX512-BF16 nor AMX" in done.stderr
    assert not (tmp_path / ".venv-vllm-cpu").exists() and not (tmp_path / ".venv").exists()
