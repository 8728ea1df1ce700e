"""Prefill of one long prompt in transformers' DeepSeek-V4: eager attention vs our sparse path.

For each prompt length, on the tiny checkpoint (float32, CPU), one `model(ids)` call (a fresh
cache, logits of the last token only) with transformers' eager attention and after
`dsv4_torch.hf.enable_sparse_prefill(model, backend="reference")`. Each point runs in a fresh
subprocess: the model is loaded and warmed up (a 16-token call), RSS is read, the peak-RSS counter
is reset (/proc/self/clear_refs "5"), the prefill runs, and "peak extra" = VmHWM - RSS before the
call (torch's CPU allocations are invisible to tracemalloc; RSS sees them). The parent watches
each child's RSS and stops it above --mem-limit-gib (or when this machine has less than 2 GiB
left) and after --timeout seconds; such points are reported with the reason, and the longer
prompts of that mode are skipped.

    python -m bench.bench_hf_prefill [--lengths 1024 4096 16384] [--out out/hf_prefill.png]
        [--threads 1] [--mem-limit-gib 12] [--timeout 600] [--checkpoint DIR] [--replot JSON]

Prints a table, writes the plot (PNG) and the figures as JSON next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from bench.common import ROOT, available_kib, child_env, module_command, proc_status_kib, reset_peak_rss

MODES = ("eager", "sparse")


# ----------------------------------------------------------------------------- child: one point


def child(args) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(args.checkpoint).eval()
    if args.mode == "sparse":
        from dsv4_torch.hf import enable_sparse_prefill, last_forward

        enable_sparse_prefill(model, backend="reference", policy="adaptive")
    ids = torch.randint(3, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :16], logits_to_keep=1)  # warm-up: lazy inits, kernels
        before = proc_status_kib("VmRSS")
        if not reset_peak_rss():  # VmHWM := current RSS
            raise RuntimeError("/proc/self/clear_refs is not writable: no peak RSS of the call alone")
        t0 = time.perf_counter()
        logits = model(ids, logits_to_keep=1).logits
        seconds = time.perf_counter() - t0
    peak = proc_status_kib("VmHWM")
    assert torch.isfinite(logits).all()
    out = {
        "mode": args.mode,
        "tokens": args.length,
        "seconds": seconds,
        "rss_before_MiB": before / 1024,
        "peak_MiB": peak / 1024,
        "peak_extra_MiB": (peak - before) / 1024,
        "threads": torch.get_num_threads(),
    }
    if args.mode == "sparse":
        rec = last_forward(model)
        out["backends"] = rec.backends
        out["workspace_rows"] = rec.step_plan.max_workspace_rows
    return out


# ----------------------------------------------------------------------------- parent


def run_point(args, mode: str, length: int) -> dict:
    cmd = module_command(
        "bench.bench_hf_prefill",
        "--child",
        "--mode",
        mode,
        "--length",
        length,
        "--checkpoint",
        args.checkpoint,
        "--threads",
        args.threads,
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    limit_kib = int(args.mem_limit_gib * 2**20)
    start, reason, max_rss = time.time(), None, 0
    while proc.poll() is None:
        try:
            rss = proc_status_kib("VmRSS", proc.pid)
        except (OSError, RuntimeError):
            rss = 0
        max_rss = max(max_rss, rss)
        if rss > limit_kib:
            reason = f"stopped: RSS over {args.mem_limit_gib:g} GiB"
        elif available_kib() < 2 * 2**20:
            reason = f"stopped: machine below 2 GiB free (RSS {rss / 2**20:.1f} GiB)"
        elif time.time() - start > args.timeout:
            reason = f"stopped: over {args.timeout} s"
        if reason:
            proc.kill()
            proc.wait()
            break
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    if reason is None and proc.returncode != 0:
        last = (stderr.strip().splitlines() or ["?"])[-1]
        reason = f"failed: {last[:120]}"
    if reason:
        return {
            "mode": mode,
            "tokens": length,
            "error": reason,
            "max_rss_MiB": max_rss / 1024,
            "elapsed": time.time() - start,
        }
    return json.loads(stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = [
        f"{'tokens':>7}  {'mode':<7} {'prefill s':>10} {'tok/s':>8} {'peak extra MiB':>15} {'peak RSS MiB':>13}  note",
        "-" * 80,
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['tokens']:>7}  {r['mode']:<7} {'-':>10} {'-':>8} {'-':>15} {'-':>13}  {r['error']}")
        else:
            note = f"workspace {r['workspace_rows']} rows" if "workspace_rows" in r else ""
            lines.append(
                f"{r['tokens']:>7}  {r['mode']:<7} {r['seconds']:>10.2f} {r['tokens'] / r['seconds']:>8.0f} "
                f"{r['peak_extra_MiB']:>15.0f} {r['peak_MiB']:>13.0f}  {note}"
            )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    style = {
        "eager": dict(color="tab:red", marker="o", label="transformers eager"),
        "sparse": dict(color="tab:blue", marker="s", label="our sparse path (reference backend)"),
    }
    for mode in MODES:
        ok = [r for r in rows if r["mode"] == mode and "error" not in r]
        bad = [r for r in rows if r["mode"] == mode and "error" in r]
        x = [r["tokens"] for r in ok]
        axes[0].plot(x, [r["peak_extra_MiB"] for r in ok], **style[mode])
        axes[1].plot(x, [r["seconds"] for r in ok], **style[mode])
        for r in bad[:1]:  # the first failed point: where the curve stops and why
            for ax in axes:
                ax.axvline(r["tokens"], color=style[mode]["color"], ls=":", lw=1)
                ax.annotate(
                    f"{mode}: {r['error']}",
                    (r["tokens"], 0.02),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    fontsize=7,
                    color=style[mode]["color"],
                    ha="right",
                    va="bottom",
                )
    ticks = sorted({r["tokens"] for r in rows})
    for ax, ylabel in zip(axes, ("peak extra RSS during the call (MiB)", "prefill time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t // 1024}K" if t % 1024 == 0 else str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens (one request)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "hf_prefill.png"), help="plot path (PNG)")
    ap.add_argument("--checkpoint", help="DeepSeek-V4 checkpoint dir (default: the tiny one, out/tiny-ckpt)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads per point (default 1: steady on a shared box)"
    )
    ap.add_argument("--mem-limit-gib", type=float, default=12.0)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per point")
    ap.add_argument("--replot", metavar="JSON", help="redraw the plot and table from an earlier run's JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        print(saved["title"] + "\n" + table(saved["rows"]))
        plot(saved["rows"], args.out, saved["title"])
        print(f"\nplot: {args.out}")
        return
    if args.checkpoint is None:
        from tools.tiny_checkpoint import write_tiny_checkpoint

        args.checkpoint = os.path.join(ROOT, "out", "tiny-ckpt")
        if not os.path.exists(os.path.join(args.checkpoint, "model.safetensors")):
            write_tiny_checkpoint(args.checkpoint, seed=0)
    rows = []
    for mode in args.modes:
        failed = None
        for n in sorted(args.lengths):
            if failed is not None:
                rows.append({"mode": mode, "tokens": n, "error": f"skipped ({failed} tokens failed)"})
                continue
            r = run_point(args, mode, n)
            rows.append(r)
            print(table([r]).splitlines()[-1], flush=True)
            if "error" in r:
                failed = n
    rows.sort(key=lambda r: (r["tokens"], r["mode"]))
    title = (
        f"DeepSeek-V4 tiny checkpoint (6 layers: SWA, CSA, HCA; 8 heads x 512; W=8, top-8), float32, CPU, "
        f"{args.threads} thread(s), one request"
    )
    print("\n" + title + "\n" + table(rows))
    plot(rows, args.out, title)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"title": title, "rows": rows}, f, indent=1)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
