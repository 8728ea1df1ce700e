"""Compile JAX programs for TPU chips and slices on a machine without a TPU (libtpu's compiler).

With `pip install libtpu` (the Python 3.12 venv of `make test-jax-new`), jax can describe a TPU
topology (`jax.experimental.topologies.get_topology_desc`) and compile for its devices: Mosaic
TPU lowers the Pallas kernels, XLA the rest; `memory_analysis()` gives per-chip HBM bytes. Two
commands do it from a CPU machine (README, "JAX on TPU"):

    .venv-jax-new/bin/python -m pytest tests/jax/test_mosaic_tpu_compile.py   # the kernels
    .venv-jax-new/bin/python -m bench.bench_tpu_compile                       # the model on slices

Used by `tests/jax/test_mosaic_tpu_compile.py`, `bench/bench_tpu_compile.py` and `bench/checks/tpu.py`.
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

# libtpu takes /tmp/libtpu_lockfile in every process that loads it; compiling without a TPU needs
# no exclusive device, so another process holding the lock (a test worker, a second bench) is fine.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# One chip of each generation (jax's topology names); slices are "<chip>:<shape>".
CHIP_TOPOLOGY = {"v4": "v4:1x1x1", "v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1", "7x": "tpu7x:1x1x1"}
TOPOLOGY_CHIP = {"v4": "v4", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "tpu7x": "7x"}


@functools.cache
def libtpu_unavailable_reason() -> str | None:
    """None if libtpu's compiler is here (topologies can be described), else why not."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return "libtpu is not installed (pip install libtpu; Python >= 3.12 with jax >= 0.12: make test-jax-new)"
    try:
        topology("v5e:1x1")
    except Exception as e:  # noqa: BLE001 - any failure means: cannot compile for TPU here
        return f"libtpu cannot describe a TPU topology here ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return None


@functools.cache
def topology(name: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu")


def chip_of_topology(name: str) -> str:
    return TOPOLOGY_CHIP[name.split(":")[0]]


def chip_device(chip: str):
    """The first device of a one-chip topology of `chip`."""
    return topology(CHIP_TOPOLOGY[chip]).devices[0]


def on_device(specs, device):
    """ShapeDtypeStructs (a pytree) placed on one topology device."""
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), specs)


def compile_for_chip(chip: str, fn, *specs, vmem_limit: int | None = None):
    """`jax.jit(fn)` compiled for one `chip` ("v5e", "v6e", "v5p", "v4", "7x"), the mosaic_tpu
    kernels inside targeting it (vmem_limit: override their scoped-VMEM limit)."""
    from dsv4_jax.kernels.mosaic_tpu import attention as mosaic_tpu

    args = on_device(specs, chip_device(chip))
    with mosaic_tpu.compile_target(chip, vmem_limit=vmem_limit):
        # a fresh function: jit caches traces per function, and the target is read while tracing
        return jax.jit(lambda *a: fn(*a)).lower(*args).compile()


_VMEM_OOM = re.compile(r"Scoped allocation with size ([\d.]+)([KMG]?)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def mosaic_vmem_bytes(chip: str, fn, *specs) -> int:
    """The scoped VMEM Mosaic allocates for the kernels of `fn` on `chip` (its own accounting, to
    its 3 significant digits): a compile with a 64 KiB limit fails and names the size."""
    try:
        compile_for_chip(chip, fn, *specs, vmem_limit=64 * 1024)
    except Exception as e:  # noqa: BLE001 - the expected out-of-VMEM failure
        m = _VMEM_OOM.search(str(e))
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2)])
        raise
    return 0  # fits in 64 KiB


# ----------------------------------------------------------------------------- prefill layer specs

# V4-Flash and V4-Pro attention (spec section 1): heads, CSA top-k; D = 512, W = 128, ratios 4 / 128.
MODELS = {"flash": dict(H=64, topk=512), "pro": dict(H=128, topk=1024)}
WINDOW, RATIOS, D = 128, {"CSA": 4, "HCA": 128, "SWA": 0}, 512
RAW_PAGE, COMP_BLOCK = 64, 256  # vLLM: raw pages of 64 tokens, compressed block 256 (S = 256 // r)


def prefill_case(model: str, kind: str, tokens: int, requests: int = 1, fp8: bool = True, query_tile: int = 16):
    """(fn, specs) of one prefill layer call on backend mosaic_tpu at real shapes: `requests`
    fresh prompts of tokens / requests tokens, caches as vLLM's pages (fp8_ds_mla, or bf16 rows)."""
    import planner as P
    from dsv4_jax import prefill as JP
    from dsv4_jax.kernels.mosaic_tpu import prefill as mosaic_tpu_prefill
    from planner.kvcache import page_bytes

    H, topk = MODELS[model]["H"], MODELS[model]["topk"]
    r = RATIOS[kind]
    n = tokens // requests
    batch = P.PrefillBatch([n] * requests, [n] * requests)
    layer = P.LayerSpec(kind, r)
    cfg = P.PlanConfig(window_size=WINDOW, max_model_len=max(n, 1), max_num_batched_tokens=max(n, 1))
    step = P.plan_step(batch, cfg, [layer])
    meta = JP.build_step_metadata(step, index_topk=topk if kind == "CSA" else None, query_tile=query_tile)
    km = meta[P.LayerKind.of(kind)]
    sds = jax.ShapeDtypeStruct

    def cache(entries, page):
        pages_per_request = -(-entries // page)
        num_pages = requests * pages_per_request + 1
        table = sds((requests, pages_per_request), jnp.int32)
        if fp8:
            return sds((num_pages, page_bytes(page)), jnp.uint8), table, page
        return sds((num_pages, page, D), jnp.bfloat16), table, page

    raw = cache(n, RAW_PAGE)
    comp = cache(max(n // r, 1), COMP_BLOCK // r) if r else None
    specs = dict(
        q=sds((meta.padded_tokens, H, D), jnp.bfloat16),
        table=sds(km.table.shape, jnp.int32),
        raw=raw[:2],
        comp=comp[:2] if comp else None,
        topk=sds((meta.padded_tokens, topk), jnp.int32) if kind == "CSA" else None,
        sink=sds((H,), jnp.float32),
    )
    kv_dtype = "fp8_ds_mla" if fp8 else "auto"

    def paged(arrays, page):
        if arrays is None:
            return None
        return JP.PagedKV(arrays[0], arrays[1], kv_cache_dtype=kv_dtype, block_size=page if fp8 else None)

    def fn(s):
        return mosaic_tpu_prefill.layer_from_table(
            s["q"],
            s["table"],
            paged(s["raw"], RAW_PAGE),
            paged(s["comp"], comp[2] if comp else None),
            s["topk"],
            s["sink"],
            shape=km.shape,
            sm_scale=D**-0.5,
            interpret=None,
        )

    return fn, specs


def flat_case(model: str, tokens: int, keys: int, rows: int = 65536, dtype=jnp.bfloat16):
    """(fn, specs) of one `sparse_attention` call on backend mosaic_tpu (FlashMLA's contract)."""
    from dsv4_jax.kernels.mosaic_tpu import attention as mosaic_tpu

    H = MODELS[model]["H"]
    sds = jax.ShapeDtypeStruct
    specs = dict(
        q=sds((tokens, H, D), dtype),
        kv=sds((rows, D), dtype),
        indices=sds((tokens, keys), jnp.int32),
        sink=sds((H,), jnp.float32),
        topk_length=sds((tokens,), jnp.int32),
    )

    def fn(s):
        return mosaic_tpu.sparse_attention_mosaic_tpu(
            s["q"], s["kv"], s["indices"], D**-0.5, s["sink"], s["topk_length"]
        )

    return fn, specs


def hbm_bytes(compiled) -> dict:
    """Per-chip HBM bytes of a compiled program (`memory_analysis()`)."""
    m = compiled.memory_analysis()
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    out = {k.removesuffix("_size_in_bytes"): int(getattr(m, k)) for k in keys}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def np_int(x) -> int:
    return int(np.asarray(x))
