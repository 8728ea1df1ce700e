"""One short TPU check of backend "mosaic_tpu"; without a TPU, its modeled cost per case.

On a TPU (never in CI):
  1. the flat kernel (FlashMLA's contract) at V4-Flash / V4-Pro shapes against the xla backend:
     agreement (FlashMLA's tolerance), run time, TFLOPS and the fraction of the chip's bf16 peak;
  2. one prefill layer per kind (fp8_ds_mla pages as vLLM lays them out) against xla: agreement,
     run time, TFLOPS by FlashMLA's count, fraction of peak;
  3. the model check: the tiny checkpoint generates the same greedy tokens with mosaic_tpu as xla.

Without a TPU (or with --model) it prints the cost model of the prefill kernel per case, beside
the same model of a per-token design like tpu-inference's sparse MLA (each token gathers its own
keys, window included; M = H rows per product): MXU FLOPs issued (our dense tiles compute masked
products too), the useful fraction, HBM bytes moved (the DMA windows: bf16 rows move in pairs, an
fp8 slot its own 576 bytes, plus each tile's copy of the scale rows of the pages it can read,
576 bytes per page), DMAs issued (HBM and VMEM-to-VMEM), and the roofline time
max(FLOPs / peak, bytes / HBM bandwidth) on the chip. The table in docs/benchmarks.md is its output.

  python -m bench.checks.tpu                 # on a TPU: the checks; elsewhere: the cost model
  python -m bench.checks.tpu --model --chip v6e
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import numpy as np

from bench.common import attention_flop, median_seconds

MODELS = {"V4-Flash": dict(H=64, topk=512), "V4-Pro": dict(H=128, topk=1024)}
D, DV, W, RATIO = 512, 512, 128, {"CSA": 4, "HCA": 128, "SWA": 0}
# (name, new tokens per request, cached context per request, requests)
CASES = [("fresh 8K prompt", 8192, 0, 1), ("2K chunk after 64K", 2048, 65536, 1), ("16 x 512 fresh", 512, 0, 16)]
FP8_SLOT_BYTES = 576  # a gathered fp8 slot moves its own 4 rows of 144 bytes (its scales come from VMEM)
FP8_SCALE_ROWS_BYTES = 576  # the scale rows of one page (S <= 72) copied into VMEM once per tile
BF16_GROUP_BYTES = 2 * 1024  # a bf16 row moves with its pair partner
USEFUL_FP8, USEFUL_BF16 = 584, 1024  # bytes of one key in the cache
RAW_PAGE, COMP_BLOCK = 64, 256  # vLLM's page sizes: raw pages of 64 tokens, compressed S = 256 // ratio


# ----------------------------------------------------------------------------- cost model


def _tiles(q_len: int, context: int, bt: int):
    """(first position, tokens) of the query tiles of one request (`query_tiles`' runs)."""
    return [(context + s, min(bt, q_len - s)) for s in range(0, q_len, bt)]


def kernel_cost(model: str, kind: str, q_len: int, context: int, requests: int, chip: str, fp8: bool = True, bt=16):
    """Modeled cost of one prefill layer of the mosaic_tpu kernel (our design)."""
    from dsv4_jax.kernels.mosaic_tpu import prefill as TP
    from dsv4_jax.kernels.mosaic_tpu import rows as R

    H, topk = MODELS[model]["H"], MODELS[model]["topk"]
    bk = R.block_shapes(chip).block_k
    hp = H
    rc = hp * max(1, min(bt, TP.ROW_CHUNK // hp))
    per_chunk = rc // hp
    r = RATIO[kind]
    comp_page = COMP_BLOCK // r if r else 0
    issued = useful = 0
    rows = 0  # gathered rows (DMA windows), zero rows included
    real_rows = 0  # rows holding a key some token of the tile reads
    scale_pages = 0  # fp8: pages whose scale rows a tile copies into VMEM
    wp, win_rows = TP.window_rows(W, bt)
    for p0, n in _tiles(q_len, context, bt):
        p_last = p0 + n - 1
        live_rows = -(-n // per_chunk) * rc  # chunks holding a token
        lo = max(0, p0 - W + 1)
        # the window: gathered once per tile, scored per token (N = Wp, padded to the MXU width)
        issued += n * 2 * hp * -(-wp // bk) * bk * (D + DV)
        rows += -(-win_rows // bk) * bk
        real_rows += p_last - lo + 1
        scale_pages += p_last // RAW_PAGE - lo // RAW_PAGE + 1
        keys = sum(min(p + 1, W) for p in range(p0, p0 + n))
        if r:
            scale_pages += -(-((p_last + 1) // r) // comp_page)
        if kind == "HCA":
            num = (p_last + 1) // r
            blocks = -(-num // bk)
            issued += blocks * 2 * live_rows * bk * (D + DV)
            rows += blocks * bk
            real_rows += num
            keys += sum((p + 1) // r for p in range(p0, p0 + n))
        elif kind == "CSA":
            for p in range(p0, p0 + n):
                c = min((p + 1) // r, topk)
                issued += -(-c // bk) * 2 * hp * bk * (D + DV)
                rows += -(-c // bk) * bk
                real_rows += c
                keys += c
        useful += attention_flop(keys, H, D, DV)
    if fp8:  # each row: data from HBM, its scale group by a VMEM-to-VMEM DMA; zero rows from VMEM
        cache_bytes = real_rows * FP8_SLOT_BYTES + scale_pages * FP8_SCALE_ROWS_BYTES
        dmas = 2 * rows + scale_pages
    else:
        cache_bytes, dmas = real_rows * BF16_GROUP_BYTES, rows
    hbm = requests * (cache_bytes + q_len * H * (D + DV) * 2)
    return dict(
        issued=requests * issued,
        useful=requests * useful,
        hbm=hbm,
        dmas=requests * dmas,
        m_rows=f"{rc} / {hp}" if kind == "HCA" else str(hp),
    )


def per_token_cost(model: str, kind: str, q_len: int, context: int, requests: int, chip: str, fp8: bool = True):
    """The same layer by a per-token design (tpu-inference's sparse MLA): every token gathers its
    own keys (window + compressed part) and scores them alone, M = H rows per product, blocks of
    the MXU width; its cache rows are read once per token (it keeps the bytes of its own layout:
    counted here at the cache's 584 / 1024 bytes per key)."""
    from dsv4_jax.kernels.mosaic_tpu import rows as R

    H, topk = MODELS[model]["H"], MODELS[model]["topk"]
    bk = R.block_shapes(chip).block_k
    r = RATIO[kind]
    issued = useful = keys_total = 0
    for p in range(context, context + q_len):
        keys = min(p + 1, W) + ((p + 1) // r if kind == "HCA" else min((p + 1) // r, topk) if kind == "CSA" else 0)
        keys_total += keys
        issued += -(-keys // bk) * 2 * H * bk * (D + DV)
        useful += attention_flop(keys, H, D, DV)
    row = USEFUL_FP8 if fp8 else USEFUL_BF16
    hbm = requests * (keys_total * row + q_len * H * (D + DV) * 2)
    return dict(issued=requests * issued, useful=requests * useful, hbm=hbm, dmas=requests * keys_total, m_rows=str(H))


def roofline_ms(cost: dict, chip: str) -> float:
    from dsv4_jax.kernels.mosaic_tpu import rows as R

    info = R.chip_info(chip)
    cores = 2 if chip in ("v4", "v5p") else 1
    return 1e3 * max(
        cost["issued"] / (info.bf16_ops_per_second * cores), cost["hbm"] / (info.mem_bw_bytes_per_second * cores)
    )


def print_cost_model(chips=("v5e", "v6e"), fp8: bool = True) -> None:
    caches = "fp8_ds_mla caches" if fp8 else "bf16 caches"
    print(
        "Modeled cost of one prefill layer, backend mosaic_tpu (ours: query tiles of 16 tokens, window rows read "
        f"once per tile and scored per token, dense HCA tiles) vs a per-token design (tpu-inference-like); {caches}"
    )
    print(
        f"{'chip':4s} {'model':8s} {'kind':4s} {'case':20s} | {'ours: TFLOP':>11s} {'useful':>6s} {'GB':>7s} "
        f"{'DMAs':>8s} {'M':>9s} {'ms':>8s} | {'per-token: TFLOP':>16s} {'useful':>6s} {'GB':>7s} {'DMAs':>8s} "
        f"{'M':>4s} {'ms':>8s} | {'ratio':>5s}"
    )
    for chip in chips:
        for model in MODELS:
            for kind in ("SWA", "CSA", "HCA"):
                for name, q_len, context, requests in CASES:
                    a = kernel_cost(model, kind, q_len, context, requests, chip, fp8)
                    b = per_token_cost(model, kind, q_len, context, requests, chip, fp8)
                    ta, tb = roofline_ms(a, chip), roofline_ms(b, chip)
                    print(
                        f"{chip:4s} {model:8s} {kind:4s} {name:20s} | {a['issued'] / 1e12:11.2f} "
                        f"{a['useful'] / a['issued']:6.0%} {a['hbm'] / 1e9:7.2f} {a['dmas']:8.2e} {a['m_rows']:>9s} "
                        f"{ta:8.2f} | {b['issued'] / 1e12:16.2f} {b['useful'] / b['issued']:6.0%} {b['hbm'] / 1e9:7.2f} "
                        f"{b['dmas']:8.2e} {b['m_rows']:>4s} {tb:8.2f} | {tb / ta:5.2f}"
                    )
    print(
        "TFLOP: MXU work issued (QK^T and PV, masked products included); useful: FlashMLA's count "
        "(2 x keys x H x (512 + 512)) over it; GB: HBM bytes moved (DMA windows, q and out); DMAs: "
        "descriptors issued (ours: HBM and VMEM-to-VMEM); M: query rows per product (ours: HCA's dense chunk rows / "
        "per-token window and CSA rows); ms: "
        "roofline max(FLOPs / bf16 peak, bytes / HBM bandwidth); ratio: per-token ms / ours."
    )


# ----------------------------------------------------------------------------- on a TPU


def _tpu_flat_check(repeat: int) -> None:
    import jax
    import jax.numpy as jnp

    import dsv4_jax
    from bench.common import random_sparse_inputs
    from dsv4_jax.kernels.mosaic_tpu import rows as R

    chip = R.target_chip()
    peak = R.chip_info(chip).bf16_ops_per_second * (2 if chip in ("v4", "v5p") else 1)
    for name, T, H, S, K in (("V4-Flash", 4096, 64, 65536, 640), ("V4-Pro", 4096, 128, 65536, 1152)):
        q, kv, idx, sink, tl, valid = random_sparse_inputs(T, H, D, S, K)
        q, kv = jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16)
        idx, sink, tl = jnp.asarray(idx), jnp.asarray(sink, jnp.float32), jnp.asarray(tl)
        outs = {}
        for backend in ("mosaic_tpu", "xla"):
            f = jax.jit(lambda *a, b=backend: dsv4_jax.sparse_attention(*a[:3], D**-0.5, *a[3:], backend=b))
            args = (q, kv, idx, sink, tl)
            outs[backend] = f(*args)
            s = median_seconds(lambda: f(*args), repeat, sync=jax.block_until_ready)
            flop = attention_flop(valid, H)
            print(
                f"{name} flat {backend:10s}: {s * 1e3:8.2f} ms  {flop / s / 1e12:7.1f} TFLOPS  {flop / s / peak:5.1%} of peak"
            )
        a, b = (np.asarray(jnp.asarray(x[0], jnp.float32)) for x in (outs["mosaic_tpu"], outs["xla"]))
        ok = np.all((np.abs(a - b) <= 8e-4) | (np.abs(a - b) <= 3 / 128 * (np.abs(b) + 1e-6)))
        print(f"{name} flat mosaic_tpu vs xla: {'PASS' if ok else 'FAIL'} (max |diff| {np.abs(a - b).max():.2e})")


def _tpu_prefill_check(repeat: int) -> None:
    import jax
    import jax.numpy as jnp

    import planner as P
    from dsv4_jax import kvcache
    from dsv4_jax import prefill as JP
    from dsv4_jax.kernels.mosaic_tpu import rows as R
    from planner.kvcache import page_bytes

    chip = R.target_chip()
    peak = R.chip_info(chip).bf16_ops_per_second * (2 if chip in ("v4", "v5p") else 1)
    rng = np.random.default_rng(0)
    for model, kind in (("V4-Flash", "CSA"), ("V4-Pro", "HCA"), ("V4-Pro", "SWA")):
        H, topk = MODELS[model]["H"], MODELS[model]["topk"]
        r, n = RATIO[kind], 4096
        batch = P.PrefillBatch([n], [n])
        cfg = P.PlanConfig(window_size=W, max_model_len=n, max_num_batched_tokens=n)
        step = P.plan_step(batch, cfg, [P.LayerSpec(kind, r)])
        meta = JP.build_step_metadata(step, index_topk=topk if kind == "CSA" else None)[kind]

        def pages(entries, S):
            num = -(-entries // S)
            k = jnp.asarray(rng.standard_normal((num * S, D)) * 0.3, jnp.bfloat16)
            cache = jnp.zeros((num, page_bytes(S)), jnp.uint8)
            cache = kvcache.quantize_and_insert_k_cache(k, cache, jnp.arange(num * S, dtype=jnp.int32), S)
            return JP.PagedKV(cache, jnp.arange(num, dtype=jnp.int32)[None], kv_cache_dtype="fp8_ds_mla", block_size=S)

        raw = pages(n, 64)
        comp = pages(max(n // r, 1), 256 // r) if r else None
        q = jnp.asarray(rng.standard_normal((meta.padded_tokens, H, D)), jnp.bfloat16)
        topk_rows = None
        if kind == "CSA":
            pos = np.arange(meta.padded_tokens)[:, None]
            ids = rng.integers(0, n // r, (meta.padded_tokens, topk))
            topk_rows = jnp.asarray(np.where(ids < (pos + 1) // r, ids, -1), jnp.int32)
        sink = jnp.zeros((H,), jnp.float32)
        keys = sum(
            min(p + 1, W) + ((p + 1) // r if kind == "HCA" else min((p + 1) // r, topk) if r else 0) for p in range(n)
        )
        outs = {}
        for backend in ("mosaic_tpu", "xla"):

            def run(b=backend):
                return JP.prefill_attention(
                    q, meta, raw, comp, sm_scale=D**-0.5, attn_sink=sink, topk_indices=topk_rows, backend=b
                )

            outs[backend] = run()
            s = median_seconds(run, repeat, sync=jax.block_until_ready)
            flop = attention_flop(keys, H)
            print(
                f"{model} {kind} prefill {backend:10s}: {s * 1e3:8.2f} ms  {flop / s / 1e12:7.1f} TFLOPS  {flop / s / peak:5.1%} of peak"
            )
        a, b = (np.asarray(jnp.asarray(o, jnp.float32))[:n] for o in (outs["mosaic_tpu"], outs["xla"]))
        ok = np.all((np.abs(a - b) <= 8e-4) | (np.abs(a - b) <= 3 / 128 * (np.abs(b) + 1e-6)))
        print(f"{model} {kind} prefill mosaic_tpu vs xla: {'PASS' if ok else 'FAIL'}")


def _tpu_model_check() -> None:
    import tempfile

    from dsv4_jax.model.generate import JaxGenerator
    from tools.tiny_checkpoint import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(tmp, seed=0, names="hf")
        rng = np.random.default_rng(1)
        prompts = [[0] + rng.integers(3, 512, size=n).tolist() for n in (40, 300, 129)]
        opts = dict(max_batch_size=4, max_model_len=512, max_num_batched_tokens=256, dtype="bfloat16")
        want = JaxGenerator(ckpt, backend="xla", **opts).generate(prompts, max_new_tokens=8)
        got = JaxGenerator(ckpt, backend="mosaic_tpu", **opts).generate(prompts, max_new_tokens=8)
        print(
            f"model check (tiny checkpoint, bf16): mosaic_tpu tokens == xla tokens: {'PASS' if got == want else 'FAIL'}"
        )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="store_true", help="print the cost model (the default without a TPU)")
    ap.add_argument("--chip", default=None, help="chips of the cost model, comma-separated (default v5e,v6e)")
    ap.add_argument("--bf16", action="store_true", help="cost model with bf16 caches instead of fp8_ds_mla")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    from dsv4_jax.kernels.mosaic_tpu import rows as R

    if args.model or R.tpu_device_chip() is None:
        if not args.model:
            print("no TPU here: the cost model instead (python -m bench.checks.tpu --model)\n")
        print_cost_model(tuple((args.chip or "v5e,v6e").split(",")), fp8=not args.bf16)
        return
    print(f"TPU: {R.tpu_device_chip()}")
    for step in (_tpu_flat_check, _tpu_prefill_check):
        t0 = time.time()
        try:
            step(args.repeat)
        except Exception:  # noqa: BLE001 - report and carry on
            traceback.print_exc(file=sys.stdout)
            print(f"{step.__name__}: FAILED")
        print(f"({step.__name__}: {time.time() - t0:.0f} s)")
    try:
        _tpu_model_check()
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        print("model check: FAILED")


if __name__ == "__main__":
    main()
