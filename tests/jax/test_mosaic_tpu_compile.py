"""The mosaic_tpu kernels compiled for real TPU chips by libtpu, on this CPU machine (AOT).

`pip install libtpu` brings the TPU compiler: jax describes a chip (`tools.tpu_aot`), Mosaic TPU
lowers the Pallas kernels for it (layouts, tiling, DMA alignment, scoped VMEM) and XLA compiles
the rest; nothing runs. By default, one compile per generation (v5e, v6e, v5p) at V4-Pro shapes
(H 128, D 512, window 128, CSA top-k 1024, 8192 tokens in 2 requests, vLLM's fp8_ds_mla pages):
the compile must succeed under the generation's VMEM limit (3/4 of 128 / 64 MiB) and the scoped
VMEM Mosaic reports must stay within it; the flat kernel per generation; bf16 rows and TPU7x; the
tiny model's CSA layer for a 4-chip v5p slice. The full matrix (V4-Flash shapes, HCA, every layer
program of the slice) runs with DSV4_TPU_FULL=1: `make test-tpu-full`.

These run in `make test-jax-new` (Python 3.12, jax >= 0.12, libtpu installed there); a jax >= 0.12
without libtpu fails them, saying why. The Python 3.11 venv (jax 0.10.2) skips them.
"""

from __future__ import annotations

import os

import jax
import pytest

from dsv4_jax.kernels.mosaic_tpu import attention as M
from dsv4_jax.kernels.mosaic_tpu import rows as R

_JAX = tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in jax.__version__.split(".")[:2])
pytestmark = pytest.mark.skipif(
    _JAX < (0, 12),
    reason=f"libtpu compile tests run in make test-jax-new (jax >= 0.12; this venv has jax {jax.__version__})",
)


FULL = os.environ.get("DSV4_TPU_FULL") == "1"
full_matrix = pytest.mark.skipif(not FULL, reason="the full mosaic_tpu matrix runs in make test-tpu-full")


@pytest.fixture(scope="module")
def aot():
    from tools import tpu_aot

    reason = tpu_aot.libtpu_unavailable_reason()
    if reason is not None:
        pytest.fail(f"cannot compile for TPU here: {reason}")
    return tpu_aot


FLAT = [("flash", 640), ("pro", 1152)]  # V4-Flash / V4-Pro heads, index widths top-k + window
CHIPS = ["v5e", "v6e", "v5p"]


def _flat(aot, chip, model, keys):
    fn, specs = aot.flat_case(model, tokens=4096, keys=keys)
    compiled = aot.compile_for_chip(chip, fn, specs)
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "dsv4_sparse_attention_tpu" in text


@pytest.mark.parametrize("chip", CHIPS)
def test_sparse_attention_compiles(aot, chip):
    _flat(aot, chip, *FLAT[1])


@full_matrix
@pytest.mark.parametrize("chip", CHIPS)
def test_sparse_attention_compiles_flash(aot, chip):
    _flat(aot, chip, *FLAT[0])


def _prefill(aot, chip, model, kind, tokens, requests):
    fn, specs = aot.prefill_case(model, kind, tokens, requests)
    compiled = aot.compile_for_chip(chip, fn, specs)
    assert f"dsv4_prefill_{kind.lower()}_tpu" in compiled.as_text()
    hbm = aot.hbm_bytes(compiled)
    H = aot.MODELS[model]["H"]
    assert hbm["output"] >= tokens * H * 512 * 2  # the layer's bf16 output, at least
    return fn, specs


@pytest.mark.parametrize("chip", CHIPS)
def test_prefill_layer_compiles_within_the_generations_vmem(aot, chip):
    """V4-Pro's CSA layer (the largest tile: H 128, top-k 1024, fp8 pages) compiles, and Mosaic's
    own scoped-VMEM figure for it is within the limit the kernel asks for (3/4 of the chip's
    VMEM) and near our estimate."""
    fn, specs = _prefill(aot, chip, "pro", "CSA", 8192, 2)
    used = aot.mosaic_vmem_bytes(chip, fn, specs)
    shapes = R.block_shapes(chip)
    assert 0 < used <= shapes.vmem_limit < shapes.vmem_capacity, (chip, used, shapes)
    assert used <= 32 * 2**20, f"{chip}: {used / 2**20:.1f} MiB for one tile"


PREFILL_FULL = [  # (model, kind, tokens, requests): fp8_ds_mla caches as vLLM lays them out
    ("flash", "CSA", 2048, 1),
    ("pro", "HCA", 4096, 1),
    ("pro", "SWA", 4096, 1),
]
CASES = [(chip, *case) for chip in CHIPS for case in PREFILL_FULL]


@full_matrix
@pytest.mark.parametrize("chip, model, kind, tokens, requests", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_prefill_layer_compiles(aot, chip, model, kind, tokens, requests):
    _prefill(aot, chip, model, kind, tokens, requests)


def test_bf16_rows_and_other_chips_compile(aot):
    """bf16 paged rows (pages of 64) instead of fp8; TPU7x, where libtpu describes it."""
    fn, specs = aot.prefill_case("flash", "SWA", 8192, 4, fp8=False)
    aot.compile_for_chip("v6e", fn, specs)
    fn, specs = aot.prefill_case("flash", "HCA", 2048, 1)
    aot.compile_for_chip("7x", fn, specs)


def test_compile_target_is_needed_without_a_tpu():
    """Outside `compile_target`, the compiled kernel refuses to run on a machine without a TPU."""
    assert M.target_chip() is None
    assert "interpret=True" in M.compiled_unavailable_reason()


def _tiny_slice(kinds):
    from bench.bench_tpu_compile import compile_step

    r = compile_step("tiny", "v5p:2x2x1", tokens=64, requests=2, context=16, kv_cache_dtype="fp8_ds_mla", kinds=kinds)
    assert r["chips"] == 4 and r["fits"]
    assert 0 < r["weights_per_chip"] < r["total_per_chip"] <= r["hbm_per_chip"]
    return r


def test_tiny_model_layer_compiles_for_a_slice(aot):
    """`bench/bench_tpu_compile.py` on the tiny checkpoint's geometry (D = 512, 8 heads, 8 experts,
    abstract FP8 / FP4 weights) for a 4-chip v5p slice: the embedding, the CSA layer program with
    the mosaic_tpu kernel inside a head-sharded shard_map, and the head compile; per-chip bytes."""
    r = _tiny_slice({"CSA"})
    assert r["mosaic_tpu_in"] == ["layer[CSA]"] and set(r["programs"]) == {"embed", "layer[CSA]", "head"}


@full_matrix
def test_tiny_model_step_compiles_for_a_slice(aot):
    """Every layer program of the step (SWA, CSA, HCA), each with the kernel inside."""
    r = _tiny_slice(None)
    assert set(r["mosaic_tpu_in"]) == {"layer[SWA]", "layer[CSA]", "layer[HCA]"}
