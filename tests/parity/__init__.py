"""Cross-backend parity suite: every backend on this machine against the float64 oracle and each other.

Modules, in reading order:
  tolerances.py   the tolerance table and the comparison it applies to every pair
  backends.py     the backends, what this machine has (and why not), DLPack crossing, runners
  cases.py        kernel-level and prefill-level cases (built on tests/cases.py)
  harness.py      runs a case on every backend, compares every pair, checks plan invariance
  hf_reference.py transformers' DeepSeek-V4 eager attention as an external reference
  report.py       `python -m tests.parity.report`: the same cases outside pytest, as a table and JSON

Triton reads TRITON_INTERPRET when a kernel module is first imported, so (as tests/conftest.py
does for pytest) it is switched on here, before anything imports a kernel, on machines without a
CUDA GPU: the torch Triton backend then runs in Triton's interpreter on CPU tensors. On a GPU,
torch and JAX share the device: JAX must not grab most of its memory up front. Where libtpu is
installed (the jax >= 0.12 venv: the TPU compiler, no TPU), every process that starts a JAX backend
loads it and takes /tmp/libtpu_lockfile; pytest-xdist's second worker (or any other process) would
then fail to describe a TPU topology, so several loads are allowed here (harmless without a TPU).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # a JAX-only environment
        pass
