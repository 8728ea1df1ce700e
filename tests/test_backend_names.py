"""Backend names: the attention kernels and the fp8_ds_mla cache kernels are two sets, named in
`planner.contract` (`BACKENDS`, `CACHE_BACKENDS`), each validated by its own resolver; one wording
for a backend that cannot run (`planner.contract.backend_unavailable`)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch

from dsv4_jax import devices as jax_devices
from dsv4_jax import kvcache as JK
from dsv4_torch import kvcache as TK
from planner.contract import BACKENDS, CACHE_BACKENDS, BackendUnavailableError, backend_unavailable


def test_cache_backends_are_named_in_the_contract():
    assert TK.BACKENDS == CACHE_BACKENDS["torch"]
    assert JK.BACKENDS == CACHE_BACKENDS["jax"]
    assert set(JK.CONCRETE_BACKENDS) == set(CACHE_BACKENDS["jax"]) - {"pallas"}
    assert str(backend_unavailable("x", "why")) == "backend='x' cannot run here: why"


@pytest.mark.parametrize("name", sorted(set(BACKENDS["jax"]) - set(CACHE_BACKENDS["jax"])))
def test_jax_cache_resolver_refuses_attention_names(name):
    with pytest.raises(ValueError, match="backend: expected one of"):
        JK.resolve_backend(name)


@pytest.mark.parametrize("name", sorted(set(BACKENDS["torch"]) - set(CACHE_BACKENDS["torch"])))
def test_torch_cache_resolver_refuses_attention_names(name):
    with pytest.raises(ValueError, match="backend: expected one of"):
        TK.resolve_backend(name)


@pytest.mark.parametrize("op", ["gather", "insert"])
def test_jax_cache_auto_on_an_nvidia_gpu_is_pallas_triton(monkeypatch, op):
    """What Hopper with jax >= 0.12 answered "mosaic_gpu" to (an attention kernel) before."""
    monkeypatch.setattr(jax_devices, "pallas_triton_unavailable", lambda arrays: None)
    assert JK.resolve_backend("auto", op=op) == "pallas_triton"
    assert JK.resolve_backend("pallas", op=op) == "pallas_triton"


def test_jax_cache_backends_without_a_gpu():
    cache = jnp.zeros((2, 64), jnp.uint8)
    if jax_devices.pallas_triton_unavailable([cache]) is None:
        pytest.skip("needs a machine without an NVIDIA GPU")
    assert JK.resolve_backend("auto", cache, op="insert") == "xla"
    assert JK.resolve_backend("auto", cache) == ("cpu" if JK.cpu_unavailable_reason() is None else "xla")
    assert JK.resolve_backend("pallas", cache) == "pallas_interpret"
    with pytest.raises(BackendUnavailableError, match="backend='pallas_triton' cannot run here: needs an NVIDIA GPU"):
        JK.resolve_backend("pallas_triton", cache)
    with pytest.raises(BackendUnavailableError, match="backend='cpu' cannot run here: it has the gather only"):
        JK.resolve_backend("cpu", cache, op="insert")


def test_torch_cache_backend_messages():
    meta = torch.empty((2, 64), dtype=torch.uint8, device="meta")
    with pytest.raises(BackendUnavailableError, match="backend='cpu' cannot run here: tensors on meta"):
        TK.resolve_backend("cpu", meta)
    with pytest.raises(BackendUnavailableError, match="backend='triton' cannot run here: tensors on meta"):
        TK.resolve_backend("triton", meta)
    assert TK.resolve_backend("auto", meta, op="insert") == "reference"
