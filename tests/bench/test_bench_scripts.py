"""Every bench script imports and answers `--help`: `python -m bench.NAME --help`, all of them in
one interpreter (runpy, as `-m` runs them), so a moved helper or a renamed API breaks this test
instead of the next benchmark run. The GPU checks' dry runs: tests/bench/test_gpu_check_scripts.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_SCRIPTS = {"__init__", "common", "serve_load"}  # shared helpers: bench/common.py; bench_vllm_serve's load side
# Modules of optional venvs: a script that cannot import without one skips, saying which.
OPTIONAL_VENVS = {"vllm": "needs vLLM 0.33.0 installed (.venv-vllm: `make test-vllm`)"}
SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in NOT_SCRIPTS)

_RUNNER = r"""
import contextlib, io, json, runpy, sys
out = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    buf = io.StringIO()
    missing = None
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        code = "returned without exiting"
    except SystemExit as e:
        code = e.code
    except ModuleNotFoundError as e:
        code, missing = f"{type(e).__name__}: {e}", e.name
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    out[name] = [code, buf.getvalue(), missing]
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def help_texts():
    """`python -m bench.NAME --help` for every script, run by one interpreter."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    modules = [f"bench.{n}" for n in SCRIPTS]
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, *modules], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS ") :])


def test_every_bench_file_is_a_script():
    assert len(SCRIPTS) >= 20, SCRIPTS
    for name in SCRIPTS:
        assert 'if __name__ == "__main__":' in (ROOT / "bench" / f"{name}.py").read_text(), (
            f"bench/{name}.py is no script"
        )


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_answers_help(help_texts, name):
    code, text, missing = help_texts[f"bench.{name}"]
    top = (missing or "").split(".")[0]
    if top in OPTIONAL_VENVS:
        pytest.skip(f"{OPTIONAL_VENVS[top]}: bench/{name}.py imports it")
    assert code in (0, None), code
    assert text.startswith("usage: "), text[:500]
