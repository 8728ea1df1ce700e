"""Which backends this machine runs: a skip with the reason for each one it cannot run."""

import numpy as np
import pytest
import torch

import dsv4_jax
import dsv4_torch
from tests.parity import backends as B
from tests.parity import cases as C
from tests.parity import harness as H


@pytest.mark.parametrize("name", [b.name for b in B.BACKENDS])
def test_backend_runs_here(name):
    st = B.machine_status()[name]
    if not st.available:
        pytest.skip(st.reason)
    be = B.BY_NAME[name]
    dtype = "bfloat16" if "float32" not in be.dtypes else "float32"
    D = 512 if be.head_dims else 64
    case = C.random_kernel_case("smoke", "smoke", dtype, seed=0, T=8, H=16, D=D, S=64, K=256)
    (row,) = H.run_kernel_cases([case], only=("oracle", name))
    assert name in row.ran and row.passed, row.failures()


def test_status_follows_the_packages():
    st = B.machine_status()
    torch_av, jax_av = dsv4_torch.available_backends(), dsv4_jax.available_backends()
    assert st["oracle"].available and st["torch.reference"].available and st["jax.xla"].available
    assert st["torch.triton"].available == (torch_av["triton"] is None)
    assert st["torch.flashmla"].available == (torch_av["flashmla"] is None)
    assert st["torch.cpu"].available == (torch_av["cpu"] is None and B.TORCH_DEVICE.type == "cpu")
    assert st["jax.triton"].kernel == "triton" and st["jax.triton"].interpreted == (jax_av["triton"] is not None)
    assert st["jax.cpu"].available == (jax_av["cpu"] is None)
    for s in st.values():
        assert s.available or (isinstance(s.reason, str) and s.reason)
    if not torch.cuda.is_available():
        assert st["torch.flashmla"].reason.startswith(B.GPU_ONLY)
        assert st["torch.triton"].interpreted and st["jax.triton"].interpreted


def test_why_not_names_the_constraint():
    fm, ref, xla = B.BY_NAME["torch.flashmla"], B.BY_NAME["torch.reference"], B.BY_NAME["jax.xla"]
    assert B.why_not(ref, "float64", 33, tiny=False) is None
    assert "float64" in B.why_not(xla, "float64", 64, tiny=True)
    if B.machine_status()["torch.flashmla"].available:
        assert "512" in B.why_not(fm, "bfloat16", 64, tiny=True)
        assert "float32" in B.why_not(fm, "float32", 512, tiny=True)
    for name in ("torch.triton", "jax.triton"):
        st = B.machine_status()[name]
        if st.available and st.interpreted:
            assert "interpreter" in B.why_not(B.BY_NAME[name], "float32", 64, tiny=False)


def test_reports_a_backend_exception_as_a_failure(monkeypatch):
    """A backend that raises is a failed row with the error, not a crash of the whole suite."""

    def broken(name, x):
        if name == "jax.xla":
            raise ValueError("kaputt")
        return real(name, x)

    real = B.run_kernel
    monkeypatch.setattr(B, "run_kernel", broken)
    case = C.random_kernel_case("smoke", "smoke", "float32", seed=0, T=8, H=16, D=64, S=64, K=256)
    (row,) = H.run_kernel_cases([case], only=("oracle", "torch.reference", "jax.xla"))
    assert not row.passed and any("jax.xla raised ValueError: kaputt" in e for e in row.errors)
    assert ("oracle", "torch.reference") in row.pairs and np.isfinite(row.cell("oracle", "torch.reference").max_abs)
