"""Session setup shared by the test files.

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a kernel, i.e. when the kernel's module
is first imported, so it has to be set before any test imports one. On a machine without a GPU
we switch the interpreter on, so the Triton kernel's tests run on CPU tensors; on a GPU machine
we leave it alone and those tests run on the GPU.
"""

import os

import pytest

if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # a JAX-only environment
        pass


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory):
    """The tiny random DeepSeek-V4 checkpoint (`write_tiny_checkpoint`, seed 0), written once per session."""
    from dsv4_torch.hf.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt") / "ckpt", seed=0)
