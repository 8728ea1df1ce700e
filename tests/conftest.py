"""Session setup shared by the test files.

`tests.parity` sets the environment every test needs before any kernel module is imported
(TRITON_INTERPRET=1 on machines without a CUDA GPU, so the Triton kernel's tests run on CPU
tensors; no up-front JAX preallocation, so torch and JAX can share a GPU); the parity report,
which runs outside pytest, imports the same.
"""

import importlib.util
import re
from pathlib import Path

import pytest

import tests.parity  # noqa: F401  (environment set-up, see above)

_VLLM_TESTS = Path(__file__).parent / "vllm"

# ----------------------------------------------------------------------------- skips
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
    (r"(torch|jax)\.\w+: needs an? .*GPU", "parity row of a GPU-only backend"),
    # a peer newer than the main venv's: the Mosaic kernel runs in `make test-jax-new` (jax >= 0.12)
    (r"the Mosaic GPU kernel needs jax >= 0\.12", "jax < 0.12 in this venv"),
    # optional peer suites and data, not part of this repository
    (r"transformers' DeepSeek-V4 model tests are not available here", "transformers' own test files absent"),
    (r"GSM8K data absent", "data set outside the repository"),
    (r"needs vLLM 0\.33\.0 installed", "vLLM venv only (`make test-vllm`)"),
)
# `pytest.importorskip` of a module that is not installed at all (not one that fails to import):
# the `make test-jax-new` venv has no torch or transformers, the default one no vLLM.
OPTIONAL_MODULES = ("torch", "transformers", "accelerate", "triton", "vllm")
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
    if reason.startswith("needs torch and transformers"):
        return not (_installed("torch") and _installed("transformers"))
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
            "(tests/conftest.py ALLOWED_SKIPS: add a reason there only if the skip is expected in CI)"
        )
        for line in _bad_skips:
            terminalreporter.line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the run (exit 1) on a skip whose reason is not allowed; xdist workers report to the
    controller, which decides."""
    if _bad_skips and not hasattr(session.config, "workerinput") and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_ignore_collect(collection_path, config):
    """tests/vllm/ runs only when named (`make test-vllm`, its own venv with vLLM): never in `make test`."""
    if Path(collection_path) == _VLLM_TESTS:
        named = any(Path(str(a).split("::")[0]).resolve().is_relative_to(_VLLM_TESTS) for a in config.args)
        return None if named else True
    return None


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """The tiny random DeepSeek-V4 checkpoint (seed 0) in both name styles, written once per session."""
    from tools.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny-ckpt")
    return {names: write_tiny_checkpoint(root / names, seed=0, names=names) for names in ("hf", "deepseek")}


# Small test models use small ratios so that short prompts reach compressed entries: the kinds come
# from `layer_types` (the tiny model's SWA, SWA, CSA, HCA, CSA, HCA), the ratios from `compress_rates`.
OTHER_COMPRESS_RATES = {"compressed_sparse_attention": 8, "heavily_compressed_attention": 32}


@pytest.fixture(scope="session")
def tiny_checkpoint_other_ratios(tmp_path_factory):
    """The tiny checkpoint (transformers' names, seed 1) with CSA ratio 8 and HCA ratio 32."""
    from tools.tiny_checkpoint import tiny_config, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny-ckpt-8-32")
    return write_tiny_checkpoint(root, seed=1, config=tiny_config(compress_rates=dict(OTHER_COMPRESS_RATES)))


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tiny_checkpoints):
    """The tiny checkpoint with transformers' names."""
    return tiny_checkpoints["hf"]
