"""GPU check of the fp8_ds_mla KV cache kernels: bytes and values vs the NumPy reference, then speed.

For an H100 / H200 / B200 machine; installs nothing. Sections (each catches its own errors):
  1. environment: GPU, HBM peak (from the device name), torch / triton / jax versions
  2. correctness, torch Triton and JAX Pallas-Triton (and JAX xla on the GPU):
       writer bytes == planner.kvcache on random + edge tokens (S = 64 and 2);
       gather values == the reference on written pages (exact) and on random bytes (any
       mismatch there is reported with its scale bytes: only bytes < 10, never written, may
       differ where a GPU flushes subnormal products)
  3. gather-dequantize speed, per backend and shape (one 64K-row request, as vLLM's first Triton
     gather was measured at ~60 GB/s on one request; 64 requests x 2K rows; the HCA cache with
     S = 2): GB/s of cache bytes read (584 per row), total traffic (+1024 written per row) as a
     share of HBM peak (target >= 70%), and a device copy of the same bytes in the same run
  4. prefill layers (SWA, CSA, HCA; V4-Flash shapes, 4 requests of 4K..32K context, 512 new
     tokens each) on fp8_ds_mla pages vs bf16 pages holding the same values, torch ("auto":
     FlashMLA or Triton, the fp8 gather a Triton kernel) and JAX ("auto": Pallas-Triton): ms per
     layer call each and the ratio; the outputs must be bitwise equal
  5. writer speed (8192 tokens) and a short launch sweep of the torch gather (block_r, warps)

Run: python -m bench.checks.gpu_kvcache [--budget 60] [--iters 20] [--dry-run]
Without a GPU it exits 0 with a message; --dry-run runs tiny shapes on CPU (Triton interpreter,
Pallas interpret mode) to check the script itself; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import numpy as np

ROW_READ = 584  # bytes of cache per gathered row: 576 data + 8 scale bytes
ROW_WRITTEN = 1024  # bytes of bf16 written per row
HBM_PEAK_GBS = {"H100": 3350.0, "H200": 4800.0, "H800": 3350.0, "B200": 8000.0, "GB200": 8000.0, "A100": 2039.0}


def section(title):
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)), flush=True)


def guarded(fn):
    def wrapper(*a, **k):
        try:
            return fn(*a, **k)
        except Exception as e:  # noqa: BLE001 - keep going, say what broke
            print(f"[error in {fn.__name__}] {type(e).__name__}: {e}")
            traceback.print_exc(limit=4)
            return None

    return wrapper


def hbm_peak(name: str) -> float | None:
    for key, gbs in HBM_PEAK_GBS.items():
        if key in name:
            return gbs
    return None


def tokens(rng, T):
    import ml_dtypes

    k = rng.standard_normal((T, 512)) * rng.choice([1e-3, 0.1, 1.0, 30.0, 1e4], (T, 1))
    k[0, :448] = 0.0
    k[1 % T, :64] = 448.0
    k[2 % T, :448] = 3.3895313892515355e38
    k[3 % T, :448] = 1e-30
    return k.astype(ml_dtypes.bfloat16).astype(np.float32)


def written_pages(rng, R, per, S):
    """R requests of `per` slots each, pages in random order, written by the reference."""
    from planner import kvcache as P

    blocks = -(-per // S)
    nb = R * blocks
    cache = np.zeros((nb, P.page_bytes(S)), np.uint8)
    k = tokens(rng, min(nb * S, 4096))
    for start in range(0, nb * S, k.shape[0]):
        n = min(k.shape[0], nb * S - start)
        P.quantize_and_insert_k_cache(k[:n], cache, np.arange(start, start + n), S)
    bt = rng.permutation(nb).astype(np.int32).reshape(R, blocks)
    return cache, np.full(R, per, np.int32), bt


def reference_gather(cache, seq, gl, bt, S, rows, offset=0):
    from planner import kvcache as P

    out = np.zeros((len(seq), rows, 512), np.float32)
    P.dequantize_and_gather_k_cache(out, cache, seq, gl, bt, S, offset)
    return out


def report_match(name, got, want, scales=None):
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    bad = int((~same).sum())
    print(f"{name}: {'PASS' if bad == 0 else 'FAIL'} ({bad} of {same.size} values differ)", flush=True)
    return bad


# ----------------------------------------------------------------------------------------------


@guarded
def environment(args, ctx):
    section("environment")
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {'cuda' if ctx['cuda'] else 'cpu'}")
    if ctx["cuda"]:
        name = torch.cuda.get_device_name()
        ctx["peak"] = hbm_peak(name)
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {name}, {props.multi_processor_count} SMs, HBM peak {ctx['peak']} GB/s (from the name)")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except Exception as e:  # noqa: BLE001
        print(f"triton: {e}")
    try:
        import jax

        print(f"jax {jax.__version__}, devices {jax.devices()}")
    except Exception as e:  # noqa: BLE001
        print(f"jax: {e}")


@guarded
def torch_correctness(args, ctx):
    section("torch: Triton kernels vs planner.kvcache")
    import torch

    from dsv4_torch import kvcache as TK
    from planner import kvcache as P

    dev = "cuda" if ctx["cuda"] else "cpu"
    rng = np.random.default_rng(0)
    for S in (64, 2):
        nb, T = 8, 8 * S - 3
        k = tokens(rng, T)
        slots = rng.permutation(nb * S)[:T]
        slots[::11] = -1
        start = rng.integers(0, 256, (nb, P.page_bytes(S)), dtype=np.uint8)
        want = start.copy()
        P.quantize_and_insert_k_cache(k, want, slots, S)
        got = torch.from_numpy(start.copy()).to(dev)
        TK.quantize_and_insert_k_cache(
            torch.from_numpy(k).to(dev, torch.bfloat16), got, torch.from_numpy(slots).to(dev), S, backend="triton"
        )
        bad = int((got.cpu().numpy() != want).sum())
        print(f"triton writer S={S}: {'PASS' if bad == 0 else 'FAIL'} ({bad} bytes differ)", flush=True)
        seq, bt = np.array([nb * S], np.int32), rng.permutation(nb).astype(np.int32)[None]
        for label, pages in (("written pages", want), ("random bytes", start)):
            ref = reference_gather(pages, seq, None, bt, S, nb * S)
            out = torch.zeros((1, nb * S, 512), dtype=torch.bfloat16, device=dev)
            TK.dequantize_and_gather_k_cache(
                out,
                torch.from_numpy(pages).to(dev),
                torch.from_numpy(seq).to(dev),
                None,
                torch.from_numpy(bt).to(dev),
                S,
                0,
                backend="triton",
            )
            report_match(f"triton gather S={S} {label}", out.float().cpu().numpy(), ref)


@guarded
def jax_correctness(args, ctx):
    section("jax: Pallas kernels and xla vs planner.kvcache")
    import jax.numpy as jnp

    from dsv4_jax import kvcache as JK
    from planner import kvcache as P

    rng = np.random.default_rng(1)
    interp = bool(args.dry_run)  # dry run on the CPU: the Pallas kernels in Pallas' interpreter
    backends = ["triton", "xla"]
    for S in (64, 2):
        nb, T = 8, 8 * S - 3
        k = tokens(rng, T)
        slots = rng.permutation(nb * S)[:T]
        slots[::11] = -1
        start = rng.integers(0, 256, (nb, P.page_bytes(S)), dtype=np.uint8)
        want = start.copy()
        P.quantize_and_insert_k_cache(k, want, slots, S)
        seq, bt = np.array([nb * S], np.int32), rng.permutation(nb).astype(np.int32)[None]
        for be in backends:
            got = JK.quantize_and_insert_k_cache(
                jnp.asarray(k, jnp.bfloat16),
                jnp.asarray(start),
                jnp.asarray(slots, jnp.int32),
                S,
                backend=be,
                interpret=interp and be == "triton",
            )
            bad = int((np.asarray(got) != want).sum())
            print(f"jax {be} writer S={S}: {'PASS' if bad == 0 else 'FAIL'} ({bad} bytes differ)", flush=True)
            for label, pages in (("written pages", want), ("random bytes", start)):
                ref = reference_gather(pages, seq, None, bt, S, nb * S)
                out = JK.dequantize_and_gather_k_cache(
                    jnp.zeros((1, nb * S, 512), jnp.bfloat16),
                    jnp.asarray(pages),
                    jnp.asarray(seq),
                    None,
                    jnp.asarray(bt),
                    S,
                    0,
                    backend=be,
                    interpret=interp and be == "triton",
                )
                report_match(f"jax {be} gather S={S} {label}", np.asarray(out.astype(jnp.float32)), ref)


def shapes(dry):
    if dry:
        return [("1 request x 256 rows, S=64", 1, 256, 64), ("4 requests x 32 rows, S=2", 4, 32, 2)]
    return [
        ("1 request x 65536 rows, S=64", 1, 65536, 64),
        ("64 requests x 2048 rows, S=64", 64, 2048, 64),
        ("8 requests x 8192 entries, S=2 (HCA)", 8, 8192, 2),
    ]


def torch_time(fn, cuda, iters):
    import torch

    fn()
    if cuda:
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)
    ts = []
    for _ in range(max(1, iters // 10)):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def print_speed(ctx, name, backend, rows, ms, copy_ms):
    read = rows * ROW_READ
    total = rows * (ROW_READ + ROW_WRITTEN)
    peak = ctx.get("peak")
    share = f"{total / ms / 1e6 / peak:6.0%}" if peak else "   n/a"
    print(
        f"{name:40s} {backend:16s} {ms:9.3f} ms {read / ms / 1e6:9.1f} GB/s read {total / ms / 1e6:9.1f} GB/s total "
        f"{share} of HBM  copy {read / copy_ms / 1e6:8.1f} GB/s  vs copy {copy_ms / ms:5.0%}",
        flush=True,
    )


@guarded
def speed(args, ctx):
    section("gather-dequantize speed (rows of cache read; total = read + bf16 written)")
    import torch

    from dsv4_torch import kvcache as TK

    dev = "cuda" if ctx["cuda"] else "cpu"
    rng = np.random.default_rng(2)
    for name, R, per, S in shapes(args.dry_run):
        if time.time() > ctx["deadline"]:
            print("budget spent: later shapes skipped")
            return
        cache, seq, bt = written_pages(rng, R, per, S)
        rows = R * per
        src = torch.randint(0, 256, (rows * ROW_READ,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_ms = torch_time(lambda: dst.copy_(src), ctx["cuda"], args.iters)
        tc, ts, tb = (torch.from_numpy(x).to(dev) for x in (cache, seq, bt))
        out = torch.empty((R, per, 512), dtype=torch.bfloat16, device=dev)
        ms = torch_time(
            lambda: TK.dequantize_and_gather_k_cache(out, tc, ts, None, tb, S, 0, backend="triton", validate=False),
            ctx["cuda"],
            args.iters,
        )
        print_speed(ctx, name, "torch triton", rows, ms, copy_ms)
        try:
            import jax
            import jax.numpy as jnp

            from dsv4_jax import kvcache as JK

            jc, js, jb = jnp.asarray(cache), jnp.asarray(seq), jnp.asarray(bt)
            for be in ["triton"] if args.dry_run else ["triton", "xla"]:
                f = jax.jit(
                    lambda o, c, s, b, be=be: JK.dequantize_and_gather_k_cache(
                        o, c, s, None, b, S, 0, backend=be, interpret=bool(args.dry_run)
                    ),
                    donate_argnums=0,
                )
                state = {"o": jnp.zeros((R, per, 512), jnp.bfloat16)}

                def run():
                    state["o"] = f(state["o"], jc, js, jb)
                    state["o"].block_until_ready()

                run()
                ts_ = []
                for _ in range(args.iters if not args.dry_run else 1):
                    t0 = time.perf_counter()
                    run()
                    ts_.append((time.perf_counter() - t0) * 1e3)
                print_speed(ctx, name, f"jax {be}", rows, statistics.median(ts_), copy_ms)
        except Exception as e:  # noqa: BLE001
            print(f"[jax speed {name}] {type(e).__name__}: {e}")


def prefill_case(dry):
    """(seq_lens, query_lens, W, topk, H): a V4-Flash-like step, or a tiny one for the dry run."""
    if dry:
        return [40, 300, 9], [8, 5, 9], 8, 8, 2
    return [8192, 16384, 32768, 4096], [512, 512, 512, 512], 128, 512, 64


def paged_pair(rng_t, lens, S, dev):
    """The same latents as fp8_ds_mla pages and as bf16 pages (the dequantized values), pages in
    random order: (fp8 pages, bf16 pages (num_pages, S, 512), block table int32)."""
    import torch

    from dsv4_torch import kvcache as TK
    from planner import kvcache as P

    counts = [-(-n // S) for n in lens]
    nb = sum(counts) + 1
    perm = torch.randperm(nb, generator=rng_t).to(dev)
    table = torch.zeros((len(lens), max(max(counts), 1)), dtype=torch.int32, device=dev)
    k, slots = [], []
    at = 0
    for i, n in enumerate(lens):
        table[i, : counts[i]] = perm[at : at + counts[i]].to(torch.int32)
        at += counts[i]
        e = torch.arange(n, device=dev)
        slots.append(table[i, e // S].long() * S + e % S)
        k.append((torch.randn((n, 512), generator=rng_t) * 0.5).to(dev, torch.bfloat16))
    fp8 = torch.zeros((nb, P.page_bytes(S)), dtype=torch.uint8, device=dev)
    if sum(lens):
        TK.quantize_and_insert_k_cache(torch.cat(k), fp8, torch.cat(slots), S, validate=False)
    flat = torch.zeros((1, nb * S, 512), dtype=torch.bfloat16, device=dev)
    TK.dequantize_and_gather_k_cache(
        flat,
        fp8,
        torch.tensor([nb * S], dtype=torch.int32, device=dev),
        None,
        torch.arange(nb, dtype=torch.int32, device=dev)[None],
        S,
        0,
        validate=False,
    )
    return fp8, flat.view(nb, S, 512), table


@guarded
def prefill_fp8_vs_bf16(args, ctx):
    section("prefill layers: fp8_ds_mla pages vs bf16 pages of the same values (bf16 q)")
    import torch

    import planner as PL
    from dsv4_torch import prefill as TP

    dev = "cuda" if ctx["cuda"] else "cpu"
    seq, qry, W, topk, H = prefill_case(args.dry_run)
    batch = PL.PrefillBatch(seq, qry)
    cfg = PL.PlanConfig(window_size=W, max_model_len=max(seq), max_num_batched_tokens=sum(qry))
    step = PL.plan_step(batch, cfg, PL.V4_LAYERS)
    meta = TP.build_step_metadata(step, device=dev, index_topk=topk)
    g = torch.Generator().manual_seed(4)
    T = batch.num_tokens
    q = (torch.randn((T, H, 512), generator=g) * 0.5).to(dev, torch.bfloat16)
    sink = torch.randn(H, generator=g).to(dev)
    pos = torch.from_numpy(batch.token_position.astype(np.int64)).to(dev)
    vis = (pos + 1) // 4
    topk_rows = (torch.rand((T, topk), generator=g).to(dev) * vis[:, None]).long().to(torch.int32)
    raw_fp8, raw_bf16, raw_table = paged_pair(g, seq, 64, dev)
    jax_inputs = {}
    print(f"step: {len(seq)} requests, contexts {seq}, {T} new tokens, H {H}, W {W}, top-k {topk}")
    for kind, r in ((PL.LayerKind.SWA, 0), (PL.LayerKind.CSA, 4), (PL.LayerKind.HCA, 128)):
        if time.time() > ctx["deadline"]:
            print("budget spent: later kinds skipped")
            return
        S = max(2, 256 // max(r, 1))
        comp = paged_pair(g, [n // r for n in seq], S, dev) if r else None
        km = meta[kind]
        tk = topk_rows if kind is PL.LayerKind.CSA else None
        outs, times = {}, {}
        for fmt in ("fp8_ds_mla", "bf16"):
            if fmt == "fp8_ds_mla":
                rk = TP.PagedKV(raw_fp8, raw_table, kv_cache_dtype=fmt, block_size=64)
                ck = TP.PagedKV(comp[0], comp[2], kv_cache_dtype=fmt, block_size=S) if comp else None
            else:
                rk = TP.PagedKV(raw_bf16, raw_table)
                ck = TP.PagedKV(comp[1], comp[2]) if comp else None
            fn = lambda rk=rk, ck=ck: TP.prefill_attention(
                q,
                km,
                rk,
                ck,
                sm_scale=512**-0.5,
                attn_sink=sink,  # noqa: E731
                topk_indices=tk,
                backend="auto",
            )
            outs[fmt] = fn()
            times[fmt] = torch_time(fn, ctx["cuda"], args.iters)
        same = torch.equal(outs["fp8_ds_mla"], outs["bf16"])
        print(
            f"torch {kind.name:3s} ({km.last_backend}): fp8 pages {times['fp8_ds_mla']:8.3f} ms, bf16 pages "
            f"{times['bf16']:8.3f} ms, fp8/bf16 {times['fp8_ds_mla'] / times['bf16']:5.2f}x, "
            f"outputs {'PASS bitwise equal' if same else 'FAIL differ'}",
            flush=True,
        )
        jax_inputs[kind] = (comp, S)
    if time.time() > ctx["deadline"] - (0 if args.dry_run else 20):
        print("budget spent: the JAX layers skipped")
        return
    try:
        import jax.numpy as jnp

        from dsv4_jax import prefill as JP
    except Exception as e:  # noqa: BLE001
        print(f"jax: {e}")
        return
    jm = JP.build_step_metadata(step, index_topk=topk)
    to_j = lambda t: (
        jnp.asarray(t.cpu().numpy())
        if t.dtype != torch.bfloat16
        else jnp.asarray(t.view(torch.int16).cpu().numpy()).view(jnp.bfloat16)
    )  # noqa: E731
    jq, jsink, jtopk = jm.pad_tokens(to_j(q)), to_j(sink), jm.pad_tokens(to_j(topk_rows))
    j_raw = (to_j(raw_fp8), to_j(raw_bf16), to_j(raw_table))
    for kind, (comp, S) in jax_inputs.items():
        if time.time() > ctx["deadline"]:
            print("budget spent: later JAX kinds skipped")
            return
        jc = tuple(to_j(t) for t in comp) if comp else None
        outs, times = {}, {}
        for fmt in ("fp8_ds_mla", "bf16"):
            if fmt == "fp8_ds_mla":
                rk = JP.PagedKV(j_raw[0], j_raw[2], kv_cache_dtype=fmt, block_size=64)
                ck = JP.PagedKV(jc[0], jc[2], kv_cache_dtype=fmt, block_size=S) if jc else None
            else:
                rk = JP.PagedKV(j_raw[1], j_raw[2])
                ck = JP.PagedKV(jc[1], jc[2]) if jc else None
            run = lambda rk=rk, ck=ck: JP.prefill_attention(
                jq,
                jm[kind],
                rk,
                ck,
                sm_scale=512**-0.5,
                attn_sink=jsink,  # noqa: E731
                topk_indices=jtopk if kind is PL.LayerKind.CSA else None,
                backend="auto",
            ).block_until_ready()
            outs[fmt] = run()
            ts_ = []
            for _ in range(args.iters if not args.dry_run else 1):
                t0 = time.perf_counter()
                run()
                ts_.append((time.perf_counter() - t0) * 1e3)
            times[fmt] = statistics.median(ts_)
        same = bool(jnp.array_equal(outs["fp8_ds_mla"], outs["bf16"]))
        print(
            f"jax   {kind.name:3s} ({jm[kind].last_backend}): fp8 pages {times['fp8_ds_mla']:8.3f} ms, bf16 pages "
            f"{times['bf16']:8.3f} ms, fp8/bf16 {times['fp8_ds_mla'] / times['bf16']:5.2f}x, "
            f"outputs {'PASS bitwise equal' if same else 'FAIL differ'}",
            flush=True,
        )


@guarded
def writer_and_sweep(args, ctx):
    section("writer speed and torch gather launch sweep")
    import torch

    from dsv4_torch import kvcache as TK
    from dsv4_torch.kernels.triton import kvcache as triton_kvcache
    from planner import kvcache as P

    dev = "cuda" if ctx["cuda"] else "cpu"
    S, T = 64, 64 if args.dry_run else 8192
    nb = -(-T // S)
    k = torch.randn((T, 512), device=dev).to(torch.bfloat16)
    cache = torch.zeros((nb, P.page_bytes(S)), dtype=torch.uint8, device=dev)
    slots = torch.randperm(nb * S, device=dev)[:T]
    ms = torch_time(
        lambda: TK.quantize_and_insert_k_cache(k, cache, slots, S, backend="triton", validate=False),
        ctx["cuda"],
        args.iters,
    )
    print(f"torch triton writer, {T} tokens: {ms:.3f} ms, {T * 1024 / ms / 1e6:.1f} GB/s of bf16 read", flush=True)
    rng = np.random.default_rng(3)
    R, per = (1, 256) if args.dry_run else (1, 65536)
    pages, seq, bt = written_pages(rng, R, per, S)
    tc, ts, tb = (torch.from_numpy(x).to(dev) for x in (pages, seq, bt))
    out = torch.empty((R, per, 512), dtype=torch.bfloat16, device=dev)
    src = torch.randint(0, 256, (R * per * ROW_READ,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = torch_time(lambda: dst.copy_(src), ctx["cuda"], args.iters)
    for block_r in (16, 32, 64):
        for warps in (4, 8):
            for workers in (None, 4 * triton_kvcache.default_workers(R, tc.device)):
                if time.time() > ctx["deadline"]:
                    print("budget spent: sweep cut short")
                    return
                fn = lambda: triton_kvcache.gather_dequant(
                    out, tc, ts, None, tb, S, 0, block_r=block_r, workers=workers, num_warps=warps
                )  # noqa: E731
                ms = torch_time(fn, ctx["cuda"], args.iters)
                print_speed(
                    ctx,
                    f"sweep block_r={block_r} warps={warps} workers={workers or 'default'}",
                    "torch triton",
                    R * per,
                    ms,
                    copy_ms,
                )
                if args.dry_run:
                    return


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=60, help="seconds; sections not started by then are skipped")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (Triton interpreter, Pallas interpret)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are imported
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("No CUDA GPU visible to torch: nothing to check here (use --dry-run to exercise the script on CPU).")
        return 0
    if args.dry_run:
        print("DRY RUN on CPU: Triton interpreter, Pallas interpret mode, tiny shapes; timings mean nothing")
    ctx = {"cuda": cuda, "deadline": time.time() + args.budget, "peak": None}
    for step in (environment, torch_correctness, jax_correctness, speed, prefill_fp8_vs_bf16, writer_and_sweep):
        if time.time() > ctx["deadline"]:
            print(f"budget spent: {step.__name__} skipped")
            continue
        step(args, ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
