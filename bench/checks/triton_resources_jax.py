"""Offline resource check of the Pallas kernel's Triton build: no GPU needed.

Lowers `dsv4_jax.kernels.triton.attention.sparse_attention_pallas` for CUDA on this machine, takes
the Triton IR that Pallas produced (`tools.aot.triton_ir`), compiles it with the `triton` pip
wheel for an SM90 (or SM100) target and runs the wheel's ptxas with -v (`tools.triton_compile`).
Prints, per tiling: shared memory, registers per
thread, spill bytes, which tensor-core instruction the dots got (wgmma, mma.sync) and
whether loads got cp.async. A tiling that spills or needs
more than 227 KB of shared memory will be slow or fail on the GPU; this finds out on a CPU.

Caveat: XLA compiles Pallas kernels with the Triton bundled in jaxlib, not the pip wheel, so
numbers are indicative (same IR, possibly different Triton passes).

  python -m bench.checks.triton_resources_jax                 # default tilings, V4-Flash and V4-Pro shapes
  python -m bench.checks.triton_resources_jax --alternatives  # pallas_triton.ALTERNATIVE_TILINGS
  python -m bench.checks.triton_resources_jax --sweep         # a grid of tilings
  python -m bench.checks.triton_resources_jax --arch 100      # Blackwell target
  python -m bench.checks.triton_resources_jax --d 576 --shape V4-Pro --tiling 64,16,256,8,2
"""

from __future__ import annotations

import argparse
import itertools
import time

from dsv4_jax.kernels.triton.attention import ALTERNATIVE_TILINGS, default_tuning
from tools.aot import triton_ir
from tools.triton_compile import compile_ttir

TILING_KEYS = ("block_h", "block_k", "block_dv", "num_warps", "num_stages")
SHAPES = {"V4-Flash": (4096, 64, 512, 65536, 640), "V4-Pro": (4096, 128, 512, 65536, 1152)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="try a grid of tilings")
    parser.add_argument("--alternatives", action="store_true", help="the kernel's ALTERNATIVE_TILINGS")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    parser.add_argument("--d", type=int, default=512, help="head dim D (512 or 576)")
    parser.add_argument(
        "--tiling",
        action="append",
        default=[],
        metavar="BH,BK,DV,WARPS,STAGES",
        help="a tiling to check (repeatable), e.g. 64,16,256,8,2",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append", help="problem shape(s) (default: all)")
    args = parser.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: nothing to check")
        return

    if args.sweep:
        tilings = [
            dict(block_h=bh, block_k=bk, block_dv=dv, num_warps=w, num_stages=s)
            for bh, bk, dv, w, s in itertools.product((32, 64), (16, 32, 64), (128, 256, 512), (4, 8), (1, 2, 3))
        ]
    elif args.alternatives:
        tilings = [None if t is None else dict(zip(TILING_KEYS, t)) for t in ALTERNATIVE_TILINGS]
    elif args.tiling:
        tilings = [dict(zip(TILING_KEYS, map(int, t.split(",")))) for t in args.tiling]
    else:
        tilings = [None]
    print(
        f"{'shape':9} {'bh':>3} {'bk':>3} {'dv':>3} {'w':>2} {'st':>2} {'smem KB':>8} {'regs':>4} {'spill B':>7} {'mma':8} cp.async  time"
    )
    for name in args.shape or SHAPES:
        T, H, D, S, K = SHAPES[name]
        D = args.d
        for tiling in tilings:
            cfg = tiling or vars(default_tuning(H, D, interpret=False))
            cfg = dict(cfg)
            t0 = time.time()
            try:
                res = compile_ttir(triton_ir(T, H, D, S, K, cfg), cfg["num_warps"], cfg["num_stages"], args.arch)
                line = (
                    f"{res['shared_kb']:8.1f} {res['regs'] or '?':>4} {res['spill_bytes'] if res['spill_bytes'] is not None else '?':>7}"
                    f" {'wgmma' if res['wgmma'] else 'mma.sync' if res['mma_sync'] else 'none':8} {str(res['cp_async']):5}"
                )
                if res["ptxas_error"]:
                    line += f"  ptxas: {res['ptxas_error']}"
            except Exception as e:  # a tiling that does not compile is a result, not a crash
                line = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            print(
                f"{name:9} {cfg['block_h']:>3} {cfg['block_k']:>3} {cfg['block_dv']:>3} {cfg['num_warps']:>2}"
                f" {cfg['num_stages']:>2} {line}  {time.time() - t0:4.1f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()
