"""The vLLM plugin's tests: `make test-vllm` (own venv `.venv-vllm` with vLLM 0.33.0; not `make test`).

tests/conftest.py leaves this directory out of every run that does not name it. Here vLLM runs on
the CPU: no GPU is visible (`CUDA_VISIBLE_DEVICES=`, set before vLLM is imported) and Triton
kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, which tests/parity sets on machines
without a GPU, before any kernel module is imported).
"""

import importlib.util
import os

import numpy as np
import pytest

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TRITON_INTERPRET", "1")


def _have_vllm() -> bool:
    """vLLM installed (this directory itself can look like a namespace package named vllm)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


HAVE_VLLM = _have_vllm()
NO_VLLM = "needs vLLM 0.33.0 installed (`make test-vllm` creates .venv-vllm with it)"


def pytest_collection_modifyitems(config, items):
    if not HAVE_VLLM:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=NO_VLLM))


@pytest.fixture(scope="session")
def vllm_plugins():
    """vLLM's own general-plugin loader run once in this process (what every vLLM process does)."""
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    return vllm.plugins


@pytest.fixture(scope="session")
def sparse_swa(vllm_plugins):
    """vLLM's sparse_swa module, imported after the plugins loaded (as in a serving process)."""
    import vllm.v1.attention.backends.mla.sparse_swa as module

    return module


@pytest.fixture(scope="session")
def vllm_plan(sparse_swa):
    """vLLM 0.33.0's own get_prefill_chunk_plan (the function the plugin replaced)."""
    from dsv4_torch.vllm.plugin import original

    fn = original(sparse_swa.DeepseekSparseSWAMetadata.get_prefill_chunk_plan)
    assert fn is not None, "the plugin did not replace get_prefill_chunk_plan"
    return fn


@pytest.fixture(scope="session")
def make_metadata(sparse_swa):
    """A DeepseekSparseSWAMetadata with the prefill fields vLLM's builder fills (CPU tensors)."""
    import torch

    def make(seq_lens, query_lens, *, window_size, max_model_len, max_num_batched_tokens, **fields):
        seq = torch.as_tensor(np.asarray(seq_lens), dtype=torch.int32)
        qry = torch.as_tensor(np.asarray(query_lens), dtype=torch.int32)
        fields.setdefault("block_table", torch.zeros((seq.shape[0], 1), dtype=torch.int32))
        fields.setdefault("slot_mapping", torch.zeros(0, dtype=torch.int64))
        fields.setdefault("block_size", 64)
        return sparse_swa.DeepseekSparseSWAMetadata(
            num_prefills=int(seq.shape[0]),
            num_prefill_tokens=int(qry.sum()),
            prefill_seq_lens_cpu=seq,
            prefill_query_lens_cpu=qry,
            prefill_window_size=window_size,
            prefill_max_model_len=max_model_len,
            prefill_max_num_batched_tokens=max_num_batched_tokens,
            **fields,
        )

    return make
