"""Compile the Triton sparse-attention kernel for a GPU architecture without a GPU; report resources.

Triton compiles ahead of time for any target (`triton.compile(..., target=GPUTarget("cuda", 90, 32))`)
and its wheel ships ptxas, so a CPU machine can see what a launch configuration costs on an
H100 (sm_90), B200 (sm_100), A100 (sm_80), L40/4090 (sm_89) or RTX 50xx (sm_120): registers a
thread, spill bytes (ptxas -v), shared memory, and whether the matmuls became wgmma (Hopper
tensor-core instructions, need BLOCK_H >= 64) or mma.sync. It cannot tell speed; the GPU
check script (bench/gpu_check_torch.py) measures that.

Run: python bench/triton_resources_torch.py [--arch 90] [--dim 576] [--dtype bf16] [--sweep]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default; silences its warning

# Max dynamic shared memory per block (bytes) by compute capability.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}

_SCALARS = ["stride_qt", "stride_qh", "stride_kvs", "stride_it", "stride_ot", "stride_oh", "stride_mt", "S", "H", "K"]


def compile_config(arch: int, dim: int, dtype: str, block_h: int, block_k: int, num_warps: int, num_stages: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4_torch.kernels import triton_sparse as ts
    from planner.oracle import value_dim

    d_v = value_dim(dim)
    sig = {
        "q_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "idx_ptr": "*i32", "sink_ptr": "*fp32", "topk_len_ptr": "*i32",
        "out_ptr": f"*{dtype}", "max_ptr": "*fp32", "lse_ptr": "*fp32", **{n: "i32" for n in _SCALARS},
        "scale_log2": "fp32",
    }
    const = dict(
        D=dim, D_V=d_v, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_DT=0 if dim == d_v else max(16, triton.next_power_of_2(dim - d_v)),
        HAS_SINK=True, HAS_TOPK_LENGTH=True, F32_DOT=dtype == "fp32", EMULATE_BF16=False,
    )
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(15)}  # pointers and strides 16-aligned
    kernel = triton.compile(
        ASTSource(ts._sparse_attention_kernel, sig, const, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx = kernel.asm["ptx"]
    info = {"smem": kernel.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync")}
    info.update(_ptxas_stats(ptx, arch))
    return info


def _ptxas_stats(ptx: str, arch: int) -> dict:
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M)  # e.g. sm_90a: compile for exactly that
    gpu_name = target.group(1) if target else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        err = ""
        for exe in ("ptxas-blackwell", "ptxas"):  # the newer one reads the newest PTX versions
            path = os.path.join(bindir, exe)
            if not os.path.exists(path):
                continue
            res = subprocess.run([path, "-v", f"--gpu-name={gpu_name}", src, "-o", os.path.join(d, "k.cubin")],
                                 capture_output=True, text=True)
            if res.returncode == 0:
                out = res.stderr
                regs = re.search(r"Used (\d+) registers", out)
                spill = re.search(r"(\d+) bytes spill stores", out)
                return {"regs": int(regs.group(1)) if regs else -1, "spill": int(spill.group(1)) if spill else 0}
            err = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "ptxas failed"
    return {"regs": -1, "spill": -1, "ptxas_error": err}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 89, 90, 100, 120")
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--heads", type=int, default=64, help="H, for the default config")
    ap.add_argument("--sweep", action="store_true", help="also compile a grid of launch configs")
    args = ap.parse_args()

    import torch

    from dsv4_torch.kernels import triton_sparse as ts

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    default = ts.default_config(args.heads, args.dim, torch_dtype, arch=args.arch)
    configs = [(default.block_h, default.block_k, default.num_warps, default.num_stages)]
    if args.sweep:
        configs += [
            (bh, bk, w, st)
            for bh in (16, 32, 64)
            for bk in (16, 32, 64)
            for w in (4, 8)
            for st in (1, 2, 3)
            if (bh, bk, w, st) != configs[0] and not (bh == 64 and w == 4)
        ]
    limit = SMEM_LIMIT.get(args.arch)
    print(f"sm_{args.arch}, D={args.dim}, {args.dtype}; default config for H={args.heads}: {default}")
    print(f"{'BLOCK_H':>7s} {'BLOCK_K':>7s} {'warps':>5s} {'stages':>6s} {'regs':>5s} {'spill B':>8s} {'smem B':>8s} {'fits':>5s} {'wgmma':>6s} {'mma.sync':>8s}")
    for bh, bk, w, st in configs:
        try:
            r = compile_config(args.arch, args.dim, args.dtype, bh, bk, w, st)
            fits = "?" if limit is None else ("yes" if r["smem"] <= limit else "NO")
            note = "" if "ptxas_error" not in r else "  " + r["ptxas_error"][:80]
            print(f"{bh:7d} {bk:7d} {w:5d} {st:6d} {r['regs']:5d} {r['spill']:8d} {r['smem']:8d} {fits:>5s} {r['wgmma']:6d} {r['mma_sync']:8d}{note}", flush=True)
        except Exception as e:  # noqa: BLE001 - e.g. out of resources at compile time
            print(f"{bh:7d} {bk:7d} {w:5d} {st:6d}  failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)


if __name__ == "__main__":
    main()
