"""Peak extra memory and time of the reference backend on a real-size call (CPU).

Default: T=8192 query tokens, H=64 heads, index width K=640 (V4-Flash CSA: top-512 + window 128),
D=512, bf16 inputs, S=32768 workspace rows. Each measurement runs in a fresh subprocess: inputs
are built first, then the peak-RSS counter is reset (Linux /proc/self/clear_refs "5") and a
sampler thread also watches VmRSS; "extra" = peak RSS during the call - RSS before it. The
outputs (out (T, H, 512) in q.dtype plus two (T, H) float32) are part of the extra; the figure
without them is the kernel's working set.

Run: python -m bench.bench_torch_reference_memory [--dtype bf16|fp32] [--tokens 8192] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.common import attention_flop, child_env, module_command, proc_status_kib, reset_peak_rss


def child(args) -> dict:
    import threading

    import torch

    import dsv4_torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    T, H, D, K, S, W = args.tokens, args.heads, args.dim, args.width, args.rows, 128
    g = torch.Generator().manual_seed(0)
    q = torch.empty((T, H, D), dtype=dtype)
    for t0 in range(0, T, 512):  # build in slices so the float32 temporaries stay small
        q[t0 : t0 + 512] = torch.randn((min(512, T - t0), H, D), generator=g) * 0.5
    kv = (torch.randn((S, D), generator=g) * 0.1).to(dtype)
    # Index rows like a CSA layer: K - W indexer picks from the compressed region, then a window.
    top = torch.randint(0, S // 2, (T, K - W), generator=g, dtype=torch.int32)
    pos = torch.arange(T, dtype=torch.int32)[:, None]
    window = S // 2 + (pos + torch.arange(W, dtype=torch.int32)[None, :]) % (S // 2)
    indices = torch.cat([top, window], dim=1).contiguous()
    topk_length = torch.full((T,), K, dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    valid = int(topk_length.sum())

    before = proc_status_kib("VmRSS")
    hwm_reset = reset_peak_rss()  # VmHWM := the current RSS, where the kernel lets us
    peak = [before]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc_status_kib("VmRSS"))
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    out, max_logits, lse = dsv4_torch.sparse_attention(q, kv, indices, D**-0.5, sink, topk_length, backend="reference")
    elapsed = time.perf_counter() - t0
    stop.set()
    th.join()
    if hwm_reset:
        peak[0] = max(peak[0], proc_status_kib("VmHWM"))
    out_bytes = out.numel() * out.element_size() + 2 * max_logits.numel() * max_logits.element_size()
    assert torch.isfinite(lse).all() and not torch.isnan(out).any()
    extra = (peak[0] - before) * 1024
    d_v = out.shape[-1]
    flop = attention_flop(valid, H, D, d_v)
    return {
        "T": T,
        "H": H,
        "D": D,
        "K": K,
        "S": S,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "rss_before_MiB": before / 1024,
        "peak_extra_MiB": extra / 2**20,
        "outputs_MiB": out_bytes / 2**20,
        "working_set_MiB": (extra - out_bytes) / 2**20,
        "seconds": elapsed,
        "tokens_per_s": T / elapsed,
        "GFLOP_per_s": flop / elapsed / 1e9,
        "hwm_reset": hwm_reset,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    cmd = module_command("bench.bench_torch_reference_memory", "--child", *sys.argv[1:])
    res = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if res.returncode != 0:
        sys.exit(f"child failed:\n{res.stdout}\n{res.stderr}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    print(
        f"reference backend, T={r['T']} H={r['H']} K={r['K']} D={r['D']} S={r['S']} {r['dtype']} inputs, "
        f"{r['threads']} threads"
    )
    print(
        f"  peak extra RSS   {r['peak_extra_MiB']:8.1f} MiB  (outputs {r['outputs_MiB']:.1f} MiB, "
        f"working set {r['working_set_MiB']:.1f} MiB; RSS before call {r['rss_before_MiB']:.0f} MiB)"
    )
    print(
        f"  time             {r['seconds']:8.2f} s    ({r['tokens_per_s']:.0f} tokens/s, "
        f"{r['GFLOP_per_s']:.1f} GFLOP/s by FlashMLA's count)"
    )
    if not r["hwm_reset"]:
        print("  (peak from a 5 ms VmRSS sampler only: /proc/self/clear_refs not writable)")


if __name__ == "__main__":
    main()
