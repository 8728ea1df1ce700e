"""Offline resource check of the Pallas kernel's Triton build: no GPU needed.

Lowers `dsv4_jax.kernels.pallas_triton.sparse_attention_pallas` for CUDA on this machine, takes the
Triton IR that Pallas produced, compiles it with the `triton` pip wheel for an SM90 (or SM100)
target and runs the wheel's ptxas with -v. Prints, per tiling: shared memory, registers per
thread, spill bytes, which tensor-core instruction the dots got (wgmma, mma.sync) and
whether loads got cp.async. A tiling that spills or needs
more than 227 KB of shared memory will be slow or fail on the GPU; this finds out on a CPU.

Caveat: XLA compiles Pallas kernels with the Triton bundled in jaxlib, not the pip wheel, so
numbers are indicative (same IR, possibly different Triton passes).

  python bench/triton_resources_jax.py                 # default tilings, V4-Flash and V4-Pro shapes
  python bench/triton_resources_jax.py --alternatives  # pallas_kernel.ALTERNATIVE_TILINGS
  python bench/triton_resources_jax.py --sweep         # a grid of tilings
  python bench/triton_resources_jax.py --arch 100      # Blackwell target
  python bench/triton_resources_jax.py --d 576 --shape V4-Pro --tiling 64,16,256,8,2
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv4_jax.aot import lower_for_cuda  # noqa: E402
from dsv4_jax.kernels.pallas_triton import ALTERNATIVE_TILINGS, default_tuning, sparse_attention_pallas  # noqa: E402

SHAPES = {"V4-Flash": (4096, 64, 512, 65536, 640), "V4-Pro": (4096, 128, 512, 65536, 1152)}


def kernel_arg_specs(T, H, D, S, K):
    """Abstract bf16 inputs of one kernel call: q, kv, indices, sink, topk_length."""
    return (
        jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((S, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((T, K), jnp.int32),
        jax.ShapeDtypeStruct((H,), jnp.float32),
        jax.ShapeDtypeStruct((T,), jnp.int32),
    )


def triton_ir(T, H, D, S, K, tiling) -> str:
    """The Triton MLIR text Pallas emits for one problem shape and tiling (CUDA lowering)."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        def f(q, kv, idx, sink, topk_length):
            return sparse_attention_pallas(q, kv, idx, D**-0.5, sink, topk_length, interpret=False, **tiling)

        lower_for_cuda(f, *kernel_arg_specs(T, H, D, S, K))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
    return captured[0]


def compile_resources(ir_text: str, num_warps: int, num_stages: int, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ir_text)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kernel = triton.compile(
                path, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
            )
        ptx = kernel.asm["ptx"]
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        # The wheel's ptxas-blackwell is the newer one (reads the PTX version Triton 3.9 emits).
        ptxas = next(p for p in (os.path.join(bindir, "ptxas-blackwell"), os.path.join(bindir, "ptxas")) if os.path.exists(p))
        sm = f"sm_{arch}a"
        log = subprocess.run([ptxas, f"-arch={sm}", "-v", ptx_path, "-o", os.devnull], capture_output=True, text=True)
        text = log.stdout + log.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {
        "shared_kb": kernel.metadata.shared / 1024,
        "regs": int(regs.group(1)) if regs else None,
        "spill_bytes": int(spills.group(1)) if spills else None,
        "wgmma": "wgmma" in ptx,
        "mma_sync": "mma.sync" in ptx,
        "cp_async": "cp.async" in ptx,
        "ptxas_error": None if log.returncode == 0 else text.strip().splitlines()[-1],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="try a grid of tilings")
    parser.add_argument("--alternatives", action="store_true", help="the kernel's ALTERNATIVE_TILINGS")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    parser.add_argument("--d", type=int, default=512, help="head dim D (512 or 576)")
    parser.add_argument(
        "--tiling", action="append", default=[], metavar="BH,BK,DV,WARPS,STAGES",
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
        keys = ("block_h", "block_k", "block_dv", "num_warps", "num_stages")
        tilings = [None if t is None else dict(zip(keys, t)) for t in ALTERNATIVE_TILINGS]
    elif args.tiling:
        keys = ("block_h", "block_k", "block_dv", "num_warps", "num_stages")
        tilings = [dict(zip(keys, map(int, t.split(",")))) for t in args.tiling]
    else:
        tilings = [None]
    print(f"{'shape':9} {'bh':>3} {'bk':>3} {'dv':>3} {'w':>2} {'st':>2} {'smem KB':>8} {'regs':>4} {'spill B':>7} {'mma':8} cp.async  time")
    for name in args.shape or SHAPES:
        T, H, D, S, K = SHAPES[name]
        D = args.d
        for tiling in tilings:
            cfg = tiling or vars(default_tuning(H, D, interpret=False))
            cfg = dict(cfg)
            t0 = time.time()
            try:
                res = compile_resources(triton_ir(T, H, D, S, K, cfg), cfg["num_warps"], cfg["num_stages"], args.arch)
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
