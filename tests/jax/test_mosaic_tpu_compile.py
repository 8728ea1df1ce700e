"""The mosaic_tpu kernels compiled for real TPU chips by libtpu, on this CPU machine (AOT).

`pip install libtpu` brings the TPU compiler: jax describes a chip (`tools.tpu_aot`), Mosaic TPU
lowers the Pallas kernels for it (layouts, tiling, DMA alignment, scoped VMEM) and XLA compiles
the rest; nothing runs. Checked at DeepSeek-V4-Flash and -Pro shapes (H 64 / 128, D 512, window
128, CSA top-k 512 / 1024, HCA ratio 128, 2048-8192 tokens, vLLM's fp8_ds_mla pages of 64 slots
and 2 at ratio 128) for v5e and v6e, and v5p: every compile must succeed under the generation's
VMEM limit (3/4 of 128 / 64 MiB), and the scoped VMEM Mosaic reports must stay within it.

These run in `make test-jax-new` (Python 3.12, jax >= 0.12, libtpu installed there); a jax >= 0.12
without libtpu fails them, saying why. The Python 3.11 venv (jax 0.10.2) skips them.
"""

from __future__ import annotations

import jax
import pytest

from dsv4_jax.kernels import mosaic_tpu as M
from dsv4_jax.kernels import mosaic_tpu_rows as R

_JAX = tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in jax.__version__.split(".")[:2])
pytestmark = pytest.mark.skipif(
    _JAX < (0, 12),
    reason=f"libtpu compile tests run in make test-jax-new (jax >= 0.12; this venv has jax {jax.__version__})",
)


@pytest.fixture(scope="module")
def aot():
    from tools import tpu_aot

    reason = tpu_aot.libtpu_unavailable_reason()
    if reason is not None:
        pytest.fail(f"cannot compile for TPU here: {reason}")
    return tpu_aot


FLAT = [("flash", 640), ("pro", 1152)]  # V4-Flash / V4-Pro heads, index widths top-k + window


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p"])
@pytest.mark.parametrize("model, keys", FLAT, ids=[m for m, _ in FLAT])
def test_sparse_attention_compiles(aot, chip, model, keys):
    fn, specs = aot.flat_case(model, tokens=4096, keys=keys)
    compiled = aot.compile_for_chip(chip, fn, specs)
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "dsv4_sparse_attention_tpu" in text


PREFILL = [  # (model, kind, tokens, requests): fp8_ds_mla caches as vLLM lays them out
    ("flash", "CSA", 2048, 1),
    ("pro", "CSA", 8192, 2),
    ("pro", "HCA", 4096, 1),
]
PREFILL_CHIPS = {"v5e": PREFILL, "v6e": PREFILL, "v5p": PREFILL[1:2]}
CASES = [(chip, *case) for chip, cases in PREFILL_CHIPS.items() for case in cases]


@pytest.mark.parametrize("chip, model, kind, tokens, requests", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_prefill_layer_compiles(aot, chip, model, kind, tokens, requests):
    fn, specs = aot.prefill_case(model, kind, tokens, requests)
    compiled = aot.compile_for_chip(chip, fn, specs)
    assert f"dsv4_prefill_{kind.lower()}_tpu" in compiled.as_text()
    hbm = aot.hbm_bytes(compiled)
    H = aot.MODELS[model]["H"]
    assert hbm["output"] >= tokens * H * 512 * 2  # the layer's bf16 output, at least


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p"])
def test_prefill_vmem_within_the_generation(aot, chip):
    """Mosaic's own scoped-VMEM figure for the largest tile (V4-Pro, CSA top-k 1024, fp8 pages)
    is within the limit the kernel asks for (3/4 of the chip's VMEM), and near our estimate."""
    fn, specs = aot.prefill_case("pro", "CSA", 8192, 2)
    used = aot.mosaic_vmem_bytes(chip, fn, specs)
    shapes = R.block_shapes(chip)
    assert 0 < used <= shapes.vmem_limit < shapes.vmem_capacity, (chip, used, shapes)
    assert used <= 32 * 2**20, f"{chip}: {used / 2**20:.1f} MiB for one tile"


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


def test_tiny_model_step_compiles_for_a_slice(aot):
    """`bench/bench_tpu_compile.py` on the tiny checkpoint's geometry (D = 512, 8 heads, 8 experts,
    abstract FP8 / FP4 weights) for a 4-chip v5p slice: embedding, the three layer programs with
    the mosaic_tpu kernel inside a head-sharded shard_map, and the head compile; per-chip bytes."""
    from bench.bench_tpu_compile import compile_step

    r = compile_step("tiny", "v5p:2x2x1", tokens=64, requests=2, context=16, kv_cache_dtype="fp8_ds_mla")
    assert r["chips"] == 4 and r["fits"]
    assert set(r["mosaic_tpu_in"]) == {"layer[SWA]", "layer[CSA]", "layer[HCA]"}
    assert 0 < r["weights_per_chip"] < r["total_per_chip"] <= r["hbm_per_chip"]
