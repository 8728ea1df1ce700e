"""Every bench script imports and answers `--help`: `python -m bench.NAME --help`, all of them in
one interpreter (runpy, as `-m` runs them), so a moved helper or a renamed API breaks this test
instead of the next benchmark run. The GPU checks' dry runs: tests/test_gpu_check_scripts.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_SCRIPTS = {"__init__", "common"}  # bench/common.py: the scripts' shared helpers
# Scripts that cannot even import without an optional venv, and that venv (none at present:
# bench_vllm_planning imports vLLM only when it measures).
NEEDS_VENV: dict[str, str] = {}

_RUNNER = r"""
import contextlib, io, json, runpy, sys
out = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        code = "returned without exiting"
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    out[name] = [code, buf.getvalue()]
print("RESULTS " + json.dumps(out))
"""


def test_every_bench_script_imports_and_answers_help():
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in NOT_SCRIPTS)
    assert len(scripts) >= 20, scripts
    for name in scripts:
        assert 'if __name__ == "__main__":' in (ROOT / "bench" / f"{name}.py").read_text(), (
            f"bench/{name}.py is no script"
        )
    modules = [f"bench.{n}" for n in scripts if n not in NEEDS_VENV]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, *modules], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS ") :])
    bad = {m: code for m, (code, text) in results.items() if code not in (0, None) or "usage:" not in text}
    assert not bad, bad
    assert set(results) == set(modules)
