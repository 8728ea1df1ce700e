"""Backend names: the attention kernels and the fp8_ds_mla cache kernels are two tables per
framework (`dsv4_torch.backends`, `dsv4_jax.backends`: `ATTENTION`, `CACHE`), each validated by its
own resolver; one wording for a backend that cannot run (`planner.contract.backend_unavailable`)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch

from dsv4_jax import backends as JB
from dsv4_jax import devices as jax_devices
from dsv4_jax import kvcache as JK
from dsv4_torch import backends as TB
from dsv4_torch import kvcache as TK
from planner.contract import BackendUnavailableError, backend_unavailable


def test_cache_backends_are_the_tables():
    assert TK.BACKENDS == tuple(TB.CACHE) and JK.BACKENDS == tuple(JB.CACHE)
    assert TB.BACKENDS == tuple(TB.ATTENTION) and JB.BACKENDS == tuple(JB.ATTENTION)
    assert str(backend_unavailable("x", "why")) == "backend='x' cannot run here: why"
    for table in (TB.ATTENTION, TB.CACHE, JB.ATTENTION, JB.CACHE):  # every entry says what it is
        assert all(b.name == name and b.summary for name, b in table.items())


@pytest.mark.parametrize("name", sorted(set(JB.ATTENTION) - set(JB.CACHE)))
def test_jax_cache_resolver_refuses_attention_names(name):
    with pytest.raises(ValueError, match="backend: expected one of"):
        JK.resolve_backend(name)


@pytest.mark.parametrize("name", sorted(set(TB.ATTENTION) - set(TB.CACHE)))
def test_torch_cache_resolver_refuses_attention_names(name):
    with pytest.raises(ValueError, match="backend: expected one of"):
        TK.resolve_backend(name)


@pytest.mark.parametrize("op", ["gather", "insert"])
def test_jax_cache_auto_on_an_nvidia_gpu_is_triton(fake_gpu, op):
    """What Hopper with jax >= 0.12 answered "mosaic_gpu" to (an attention kernel) before."""
    assert JK.resolve_backend("auto", op=op) == "triton"
    assert JK.resolve_backend("triton", op=op) == "triton"


def test_jax_cache_backends_without_a_gpu():
    cache = jnp.zeros((2, 64), jnp.uint8)
    if jax_devices.triton_unavailable([cache]) is None:
        pytest.skip("needs a machine without an NVIDIA GPU")
    assert JK.resolve_backend("auto", cache, op="insert") == "xla"
    assert JK.resolve_backend("auto", cache) == ("cpu" if JK.cpu_unavailable_reason() is None else "xla")
    assert JK.resolve_backend("triton", cache, interpret=True) == "triton"
    with pytest.raises(BackendUnavailableError, match="backend='triton' cannot run here: needs an NVIDIA GPU"):
        JK.resolve_backend("triton", cache)
    with pytest.raises(BackendUnavailableError, match="backend='cpu' cannot run here: it has the gather only"):
        JK.resolve_backend("cpu", cache, op="insert")


def test_torch_cache_backend_messages():
    meta = torch.empty((2, 64), dtype=torch.uint8, device="meta")
    with pytest.raises(BackendUnavailableError, match="backend='cpu' cannot run here: tensors on meta"):
        TK.resolve_backend("cpu", meta)
    with pytest.raises(BackendUnavailableError, match="backend='triton' cannot run here: tensors on meta"):
        TK.resolve_backend("triton", meta)
    assert TK.resolve_backend("auto", meta, op="insert") == "reference"
