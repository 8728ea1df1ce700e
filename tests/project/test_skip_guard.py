"""The suite cannot pass by skipping: a skip whose reason is not on tests/skip_guard.py's allow-list
fails the run (exit code 1), xfail and allowed skips do not."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.skip_guard import skip_allowed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_allow_list():
    assert skip_allowed("needs an SM90/SM100 GPU")
    assert skip_allowed("Skipped: GSM8K data absent: expected test.jsonl/train.jsonl in ../shared/gsm8k")
    assert skip_allowed("the Mosaic GPU kernel needs jax >= 0.12 (Pallas Mosaic GPU ...), found jax 0.10.2")
    # a module that fails to import is a failure, not a skip; only an absent optional one skips
    assert not skip_allowed("could not import 'dsv4_torch.kvcache': No module named 'triton'")
    assert not skip_allowed("could not import 'torch': cannot load libtorch")  # torch is installed here
    assert skip_allowed("could not import 'vllm': No module named 'vllm'")  # not installed in this venv
    assert not skip_allowed("the cpu backend's C kernel cannot be built here: no C compiler")
    assert not skip_allowed("")
    assert not skip_allowed("the torch side needs torch (the jax-only `make test-jax-new` run has none)")  # it is here


def test_unlisted_skip_fails_the_run(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_gpu():\n    pytest.skip('needs an SM90/SM100 GPU')\n"
        "@pytest.mark.xfail(strict=True, reason='known')\ndef test_known():\n    raise AssertionError\n"
        "def test_ok():\n    pass\n"
        "def test_hidden():\n    pytest.skip('a kernel did not build')\n"
    )

    def run(*names):
        args = [f"{tmp_path / 'test_x.py'}::{n}" for n in names]
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            "--rootdir",
            str(tmp_path),
            *args,
        ]
        return subprocess.run(
            cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300
        )

    ok = run("test_gpu", "test_known", "test_ok")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    bad = run("test_ok", "test_hidden")
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert "skips not on the allow-list" in bad.stdout and "test_hidden: a kernel did not build" in bad.stdout
