"""The suite cannot pass by skipping: a pytest plugin (loaded by tests/conftest.py) that fails the
run (exit code 1) when a test is skipped for a reason not on `ALLOWED_SKIPS`, and lists those skips
at the end. A broken import or a kernel that no longer builds must not pass as "skipped". xfail
is not a skip; xdist workers report to the controller, which decides.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

# A run fails when a test is skipped for a reason not listed here: a broken import or a kernel that
# no longer builds must not pass as "skipped". Each entry: (pattern matched at the start of the
# skip reason, why such a skip is expected).
ALLOWED_SKIPS = (
    # no GPU here (or a GPU here, for the CPU-only variants): the GPU runs are `python -m bench.gpu_check`
    (r"needs an SM90/SM100 GPU", "GPU-only test"),
    (r"a GPU is visible: ", "CPU-only dry run of a GPU script"),
    (r"needs a machine without an NVIDIA GPU", "CPU-only check"),
    (r"CPU-only check", "CPU-only check"),
    (r"checks the interpreter \(CPU, TRITON_INTERPRET=1\)", "CPU-only check"),
    (r"needs Triton's bundled ptxas \(NVIDIA build of triton\)", "GPU toolchain absent"),
    # a peer newer than the main venv's: the Mosaic kernel runs in `make test-jax-new` (jax >= 0.12)
    (r"the Mosaic GPU kernel needs jax >= 0\.12", "jax < 0.12 in this venv"),
    # no TPU: the Pallas TPU kernels run in TPU interpret mode in tests/jax/test_mosaic_tpu.py (a
    # selection; every parity case with DSV4_PARITY_TPU_INTERPRET=1), and compile for real chips
    # with libtpu in the Python 3.12 venv only
    (r"no TPU here, and TPU interpret mode is too slow for every parity case", "no TPU; interpret mode is slow"),
    (r"libtpu compile tests run in make test-jax-new", "jax < 0.12 / no libtpu in this venv"),
    (r"the full mosaic_tpu matrix runs in make test-tpu-full", "CI runs one case per point; DSV4_TPU_FULL=1 all"),
    # optional peer suites and data, not part of this repository
    (r"transformers' DeepSeek-V4 model tests are not available here", "transformers' own test files absent"),
    (r"GSM8K data absent", "data set outside the repository"),
    (r"needs vLLM 0\.33\.0 installed", "vLLM venv only (`make test-vllm`)"),
    (r"runs in make test-sanitize", "the sanitizer build's own run"),
)
# `pytest.importorskip` of a module that is not installed at all (not one that fails to import):
# the `make test-jax-new` venv has no torch or transformers, the default one no vLLM.
OPTIONAL_MODULES = ("torch", "transformers", "accelerate", "triton", "vllm")
# Skips that say a module is missing: allowed only where it is not installed.
WHEN_NOT_INSTALLED = (
    (r"needs torch and transformers", ("torch", "transformers")),
    (r"the torch side needs torch", ("torch",)),  # torch == jax checks, in the jax-only venv
)
_IMPORT_SKIP = re.compile(r"could not import '([\w.]+)'")
_bad_skips: list[str] = []


def skip_allowed(reason: str) -> bool:
    """Whether a skip with this reason is expected (see ALLOWED_SKIPS / OPTIONAL_MODULES)."""
    reason = reason.removeprefix("Skipped: ")
    if any(re.match(pattern, reason) for pattern, _ in ALLOWED_SKIPS):
        return True
    m = _IMPORT_SKIP.match(reason)
    if m:
        top = m.group(1).split(".")[0]
        return top in OPTIONAL_MODULES and not _installed(top)
    for pattern, modules in WHEN_NOT_INSTALLED:
        if re.match(pattern, reason):
            return not all(_installed(m) for m in modules)
    return False


def _installed(module: str) -> bool:
    """An installed module (a directory of this repository, e.g. tests/vllm, seen as a namespace
    package does not count)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if not skip_allowed(reason):
            _bad_skips.append(f"{report.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter):
    if _bad_skips:
        terminalreporter.section("skips not on the allow-list", red=True)
        terminalreporter.line(
            "(tests/skip_guard.py ALLOWED_SKIPS: add a reason there only if the skip is expected in CI)"
        )
        for line in _bad_skips:
            terminalreporter.line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the run (exit 1) on a skip whose reason is not allowed; xdist workers report to the
    controller, which decides."""
    if _bad_skips and not hasattr(session.config, "workerinput") and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
