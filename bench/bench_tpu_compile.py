"""The JAX DeepSeek-V4 model's prefill step compiled for TPU slices, with no weight files.

Weights are abstract (`jax.ShapeDtypeStruct`s of the official release's tensors, FP8 linears and
FP4 experts as shipped, with the shardings `dsv4_jax.model.parallel` gives over one mesh axis of
all the slice's chips); the step's inputs, caches and per-kind plan metadata come from a real
host plan (`DeepseekV4.prepare_step`). libtpu compiles the step's programs for the slice (the
embedding, one program per layer kind with the mosaic_tpu prefill kernel inside, the head), and
`memory_analysis()` gives each program's per-chip bytes. Per chip the step needs the weights it
holds (every layer's), the caches (replicated, every layer's) and the largest transient of a
program (its temporaries and outputs); a model fits a slice when that sum is within the chip's HBM.

  .venv-jax-new/bin/python -m bench.bench_tpu_compile                      # both models, default slices
  .venv-jax-new/bin/python -m bench.bench_tpu_compile --models flash --slices v5p:2x2x1 --tokens 2048

Needs jax >= 0.12 and libtpu (the `make test-jax-new` venv). Prints a table and, with --json, the
figures. Compiles take minutes per slice on a 2-core machine (V4-Pro's MoE layers are large).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_SLICES = ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x4x4", "v6e:2x4", "v6e:4x4", "v5e:2x4", "v5e:4x4")
MODELS = {"flash": "V4-Flash", "pro": "V4-Pro", "tiny": "tiny"}  # tiny: the test checkpoint's geometry
MEGACORE = {"v4", "v5p"}  # one JAX device = both TensorCores of a chip


def hbm_per_chip(chip: str) -> int:
    from dsv4_jax.kernels.mosaic_tpu import rows as R

    cores = 2 if chip in MEGACORE else 1
    return int(R.chip_info(chip).hbm_capacity_bytes) * cores


def abstract_params(model: str, mesh, axis: str):
    """(ModelConfig, the parameter tree as ShapeDtypeStructs placed on `mesh`), as `load_params`
    with weights="stored" would build it from the official checkpoint's headers."""

    from jax.sharding import NamedSharding

    from dsv4_jax.model import parallel
    from dsv4_jax.model.checkpoint import _device_dtype, _Entry, plan_params
    from dsv4_jax.model.config import ModelConfig
    from dsv4_jax.model.quant import QuantizedWeight
    from planner.contract import PRESETS
    from tools import official_checkpoint as oc

    cfg_dict = PRESETS[MODELS[model]]
    config = ModelConfig.from_dict(cfg_dict)

    files = oc.LayoutHeaders(oc.official_layout(cfg_dict))  # the official layout's headers, no files
    tree, tied = plan_params(config, files)
    n = parallel.axis_size(mesh, axis)

    def sds(shape, dtype, spec):
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec))

    def one(e: _Entry):
        src = e.source
        if src.part is not None:
            info = files.info(src.part.name)
            data_shape, dtype = tuple(info.shape), _device_dtype(info.dtype, e.kind)
            sinfo = files.info(src.part.scale) if e.fmt else None
            scale_shape = tuple(sinfo.shape) if sinfo else None
        else:
            first = src.experts[0]
            i0 = files.info(first[0].name)
            data_shape = (len(src.experts), sum(files.info(p.name).shape[0] for p in first), i0.shape[1])
            dtype = _device_dtype(i0.dtype, e.kind)
            sinfo = files.info(first[0].scale) if e.fmt else None
            rows = sum(files.info(p.scale).shape[0] for p in first) if e.fmt else 0
            scale_shape = (len(src.experts), rows, sinfo.shape[1]) if sinfo else None
        data = sds(data_shape, dtype, parallel.spec(e.role, data_shape, n, axis))
        if not e.fmt:
            return data
        sdt = _device_dtype(sinfo.dtype, "w")
        scale = sds(scale_shape, sdt, parallel.spec(e.role, scale_shape, n, axis, e.block, e.shape))
        return QuantizedWeight(data, scale, e.fmt, e.block)

    params = jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, _Entry))
    if tied:
        params["head"] = params["embed"]
    return config, params


def _bytes_per_chip(tree) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += int(np.prod(shape)) * jnp.dtype(leaf.dtype).itemsize
    return total


def compile_step(model: str, topology: str, tokens: int, requests: int, context: int, kv_cache_dtype: str, kinds=None):
    """Compile one prefill step of `model` for the slice `topology`; returns the figures. kinds:
    the layer kinds whose program is compiled (names; None: every kind of the model; the figures
    then cover only those)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from dsv4_jax.kernels.mosaic_tpu import attention as mosaic_tpu
    from dsv4_jax.model import model as MM
    from dsv4_jax.model.attention import init_cache
    from dsv4_jax.model.layers import resolve_expert_matmul
    from tools import tpu_aot

    chip = tpu_aot.chip_of_topology(topology)
    devices = tpu_aot.topology(topology).devices
    mesh = Mesh(np.array(devices), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    config, params = abstract_params(model, mesh, "tp")
    n = len(devices)
    per = tokens // requests
    max_model_len = context + per
    # A host-only model object for the plan and step inputs (no mesh: nothing is placed on the slice).
    host = MM.DeepseekV4(
        config,
        params,
        max_batch_size=requests,
        max_model_len=max_model_len,
        max_num_batched_tokens=per,
        backend="xla",
        dtype="bfloat16",
        min_requests=1,
    )
    step, rows, meta, plan = host.prepare_step(list(range(requests)), [context] * requests, [[1] * per] * requests)
    whole = NamedSharding(mesh, P())

    def abstract(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=whole), tree)

    step_s, rows_s = abstract(step), abstract(rows)
    caches = jax.eval_shape(lambda: init_cache(config, requests, max_model_len, jnp.bfloat16, kv_cache_dtype))
    caches = [abstract(c) for c in caches]
    # The indexer named too: lowered here, "auto" would follow the host's default device (the CPU)
    # and pick the C kernel's FFI call, which a TPU program cannot hold.
    opts = (("backend", "mosaic_tpu"), ("indexer_backend", "xla"), ("interpret", False), ("mesh", mesh), ("axis", "tp"))
    opts += (("expert_matmul", resolve_expert_matmul("auto", "tpu")),)  # the model's choice on a TPU
    if kv_cache_dtype != "auto":
        opts += (("kv_cache_dtype", kv_cache_dtype), ("max_model_len", max_model_len))
    out = dict(model=MODELS[model], slice=topology, chips=n, chip=chip, tokens=tokens, requests=requests)
    out["context"] = context
    programs = {}
    t0 = time.perf_counter()
    with mosaic_tpu.compile_target(chip):
        X = jax.eval_shape(
            lambda e, t: MM._embed(e, t, cfg=config, dtype=jnp.bfloat16, mesh=mesh, axis="tp"),
            params["embed"],
            step_s.token_ids,
        )
        X = jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=whole)
        programs["embed"] = MM._embed.lower(
            params["embed"], step_s.token_ids, cfg=config, dtype=jnp.bfloat16, mesh=mesh, axis="tp"
        ).compile()
        route = jax.ShapeDtypeStruct((X.shape[0], config.num_experts_per_tok), jnp.int32, sharding=whole)
        flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=whole)
        layer_params = host._layer_params
        for kind in sorted(set(config.kinds), key=lambda k: k.name):
            if kinds is not None and kind.name not in kinds:
                continue
            i = config.kinds.index(kind)
            lp = {k: v for k, v in layer_params[i].items()}
            lp["ffn"] = {k: v for k, v in lp["ffn"].items()}
            if not isinstance(lp["ffn"]["bias"], jax.ShapeDtypeStruct):  # the model's zero stand-in
                lp["ffn"]["bias"] = jax.ShapeDtypeStruct(
                    lp["ffn"]["bias"].shape, lp["ffn"]["bias"].dtype, sharding=whole
                )
            km = abstract(meta[kind])
            programs[f"layer[{kind.name}]"] = MM._layer.lower(
                lp, caches[i], X, step_s, km, route, flag, cfg=config, kind=kind, opts=opts
            ).compile()
        head = {k: params[k] for k in ("hc_head", "norm", "head")}
        programs["head"] = MM._head.lower(head, X, rows_s, cfg=config, mesh=mesh).compile()
    out["compile_seconds"] = round(time.perf_counter() - t0, 1)
    figures = {name: tpu_aot.hbm_bytes(c) for name, c in programs.items()}
    weights = _bytes_per_chip(params)
    cache = sum(_bytes_per_chip(c) for c in caches)
    transient = max(f["temp"] + f["output"] - f["alias"] for f in figures.values())
    out.update(programs=figures, weights_per_chip=weights, caches_per_chip=cache, transient_per_chip=transient)
    out["total_per_chip"] = weights + cache + transient
    out["hbm_per_chip"] = hbm_per_chip(chip)
    out["fits"] = out["total_per_chip"] <= out["hbm_per_chip"]
    kernels = [name for name, c in programs.items() if "dsv4_prefill_" in c.as_text()]
    out["mosaic_tpu_in"] = kernels
    return out


def gb(x) -> str:
    return f"{x / 1e9:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="flash,pro")
    ap.add_argument("--slices", default=",".join(DEFAULT_SLICES), help="jax topology names, e.g. v5p:2x2x1")
    ap.add_argument("--tokens", type=int, default=8192, help="new tokens in the step")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--context", type=int, default=0, help="tokens already cached per request")
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=("fp8_ds_mla", "auto"))
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    from tools import tpu_aot

    if (reason := tpu_aot.libtpu_unavailable_reason()) is not None:
        raise SystemExit(f"bench_tpu_compile: {reason}")
    rows = []
    print(
        f"{'model':9s} {'slice':11s} {'chips':>5s} {'weights':>8s} {'caches':>7s} {'transient':>9s} "
        f"{'total':>7s} {'HBM':>6s}  fits  compile s   (GB per chip)"
    )
    for model in args.models.split(","):
        for topology in args.slices.split(","):
            try:
                r = compile_step(model, topology, args.tokens, args.requests, args.context, args.kv_cache_dtype)
            except Exception as e:  # noqa: BLE001 - a slice that does not split the model, or a compile error
                print(f"{MODELS[model]:9s} {topology:11s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                rows.append(dict(model=MODELS[model], slice=topology, error=f"{type(e).__name__}: {e}"[:2000]))
                continue
            rows.append(r)
            print(
                f"{r['model']:9s} {topology:11s} {r['chips']:5d} {gb(r['weights_per_chip']):>8s} "
                f"{gb(r['caches_per_chip']):>7s} {gb(r['transient_per_chip']):>9s} {gb(r['total_per_chip']):>7s} "
                f"{gb(r['hbm_per_chip']):>6s}  {'yes' if r['fits'] else 'no ':4s}  {r['compile_seconds']:9.1f}",
                flush=True,
            )
    for model in args.models.split(","):
        fits = [r for r in rows if r.get("model") == MODELS[model] and r.get("fits")]
        best = min(fits, key=lambda r: (r["chips"], r["slice"])) if fits else None
        print(f"{MODELS[model]}: smallest slice that fits: {best['slice'] if best else 'none of those tried'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
