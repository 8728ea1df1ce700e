"""Session setup shared by the test files.

`tests.parity` sets the environment every test needs before any kernel module is imported
(TRITON_INTERPRET=1 on machines without a CUDA GPU, so the Triton kernel's tests run on CPU
tensors; no up-front JAX preallocation, so torch and JAX can share a GPU); the parity report,
which runs outside pytest, imports the same.
"""

from pathlib import Path

import pytest

import tests.parity  # noqa: F401  (environment set-up, see above)

# A run fails when a test is skipped for a reason not on tests/skip_guard.py's allow-list.
pytest_plugins = ("tests.skip_guard",)

_VLLM_TESTS = Path(__file__).parent / "vllm"
_VLLM_CPU_TESTS = Path(__file__).parent / "vllm_cpu"


def pytest_ignore_collect(collection_path, config):
    """tests/vllm/ and tests/vllm_cpu/ run only when named (`make test-vllm`, `make test-vllm-cpu`,
    each in its own venv with vLLM): never in `make test`."""
    for own in (_VLLM_TESTS, _VLLM_CPU_TESTS):
        if Path(collection_path) == own:
            named = any(Path(str(a).split("::")[0]).resolve().is_relative_to(own) for a in config.args)
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


@pytest.fixture
def fake_gpu(monkeypatch):
    """JAX's default device becomes a pretend NVIDIA GPU (Hopper, compute capability 9.0):
    uncommitted and traced arrays resolve "auto" as on a GPU machine; committed CPU arrays keep
    their CPU. Returns the fake device."""
    from types import SimpleNamespace

    from dsv4_jax import devices

    class FakeGPU:
        platform = "gpu"
        device_kind = "NVIDIA H100 80GB HBM3"
        compute_capability = "9.0"
        id = 0
        client = SimpleNamespace(platform_version="cuda 12.8")

        def __repr__(self):
            return "FakeGPU(H100)"

    gpu = FakeGPU()
    monkeypatch.setattr(devices, "default_device", lambda: gpu)
    return gpu
