"""Compile the Triton sparse-attention kernel for a GPU architecture without a GPU; report resources.

Triton compiles ahead of time for any target (`triton.compile(..., target=GPUTarget("cuda", 90, 32))`)
and its wheel ships ptxas, so a CPU machine can see what a launch configuration costs on an
H100 (sm_90), B200 (sm_100), A100 (sm_80), L40/4090 (sm_89) or RTX 50xx (sm_120): registers a
thread, spill bytes (ptxas -v), shared memory, whether the matmuls became wgmma (Hopper,
BLOCK_H >= 64), tcgen05 (datacenter Blackwell) or mma.sync, and how many local-memory
loads/stores (spills) sit inside the key loop (nvdisasm). It cannot tell speed; the GPU check
script (`python -m bench.checks.gpu_torch`) measures that.

Run: python -m bench.checks.triton_resources_torch [--arch 90] [--dim 576] [--dtype bf16] [--sweep]
     [--configs "64,16,8,2 64,32,8,1"]   (unset TRITON_INTERPRET first)

Figures (Triton 3.9, bf16, H = 64; regs / spill B / loop LDL+STL / smem B):

  config             sm_90 D=512          sm_90 D=576          sm_100 D=512      sm_100 D=576
  64,32,8,2 before   255/88/-/131200      255/128/-/147584     239/0/-/164512    251/0/-/144040
  64,32,8,2 after    255/52/2/131200      255/92/19/147584     235/0/0/164512    247/0/0/144040
  64,16,8,2          255/0/0/98368        255/32/0/110656      226/0/0/115296    238/0/0/109160
  64,32,8,1          255/64/-/98304       255/112/-/110592     255/0/-/98816     255/48/-/110600
  64,64,8,1          255/72/-/131080      255/156/-/147456     255/60/-/131584   255/120/-/147464
  64,32,16,2         128/332/-/131200     128/432/-/147584

"before" is the earlier kernel, which added the P@V product to the rescaled accumulator instead
of feeding the accumulator to tl.dot (a second 64 x 512 fp32 temporary); every other row is the
current kernel ("-": not measured). sm_80 and sm_120 run BLOCK_H = 32 (32,32,8,2): 180-186
registers, no spills, 67712 / 75904 B of shared memory (fits sm_120's ~100 KB; BLOCK_K = 64
does not). Defaults per arch: `dsv4_torch.kernels.triton.attention.default_config`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

from tools.triton_compile import ptxas_stats, triton_bin_dir

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default; silences its warning

# Max dynamic shared memory per block (bytes) by compute capability.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}

_SCALARS = ["stride_qt", "stride_qh", "stride_kvs", "stride_it", "stride_ot", "stride_oh", "stride_mt", "S", "H", "K"]


def compile_config(
    arch: int, dim: int, dtype: str, block_h: int, block_k: int, num_warps: int, num_stages: int
) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4_torch.kernels.triton import attention as ts
    from planner.oracle import value_dim

    d_v = value_dim(dim)
    sig = {
        "q_ptr": f"*{dtype}",
        "kv_ptr": f"*{dtype}",
        "idx_ptr": "*i32",
        "sink_ptr": "*fp32",
        "topk_len_ptr": "*i32",
        "out_ptr": f"*{dtype}",
        "max_ptr": "*fp32",
        "lse_ptr": "*fp32",
        **{n: "i32" for n in _SCALARS},
        "scale_log2": "fp32",
    }
    const = dict(
        D=dim,
        D_V=d_v,
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_DT=0 if dim == d_v else max(16, triton.next_power_of_2(dim - d_v)),
        HAS_SINK=True,
        HAS_TOPK_LENGTH=True,
        F32_DOT=dtype == "fp32",
        EMULATE_BF16=False,
        INTERPRETER=False,
    )
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(15)}  # pointers and strides 16-aligned
    kernel = triton.compile(
        ASTSource(ts._sparse_attention_kernel, sig, const, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx = kernel.asm["ptx"]
    info = {
        "smem": kernel.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
        "tcgen05": ptx.count("tcgen05.mma"),
    }
    info.update(ptxas_stats(ptx, arch))
    info["loop_spill"] = _loop_spill_ops(kernel.asm.get("cubin"))
    return info


def _loop_spill_ops(cubin: bytes | None) -> int:
    """Local-memory loads/stores (LDL/STL) inside the kernel's loops, from nvdisasm; -1 if unknown.

    Spills of loop-invariant values (addresses, masks for the epilogue) sit before and after the
    key loop and cost a few bytes per program; the ones inside the loop are the expensive kind.
    """
    exe = os.path.join(triton_bin_dir(), "nvdisasm")
    if not cubin or not os.path.exists(exe):
        return -1
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([exe, "-c", path], capture_output=True, text=True)
    if res.returncode != 0:
        return -1
    lines = res.stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line.strip()))}
    loops = [  # a branch back to an earlier label closes a loop
        (labels[m.group(1)], i)
        for i, line in enumerate(lines)
        if (m := re.search(r"\bBRA\b.*\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i
    ]
    spill = re.compile(r"\b(LDL|STL)(\.\S+)?\s")
    return sum(1 for i, line in enumerate(lines) if spill.search(line) and any(a < i < b for a, b in loops))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 89, 90, 100, 120")
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--heads", type=int, default=64, help="H, for the default config")
    ap.add_argument("--sweep", action="store_true", help="also compile a grid of launch configs")
    ap.add_argument(
        "--configs", default="", help="also compile these, e.g. '64,64,8,1 64,32,8,1' (BLOCK_H,BLOCK_K,warps,stages)"
    )
    args = ap.parse_args()

    import torch

    from dsv4_torch.kernels.triton import attention as ts

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
    for spec in args.configs.split():
        cfg = tuple(int(x) for x in spec.split(","))
        if len(cfg) != 4:
            ap.error(f"--configs: expected BLOCK_H,BLOCK_K,warps,stages, got {spec!r}")
        if cfg not in configs:
            configs.append(cfg)
    limit = SMEM_LIMIT.get(args.arch)
    print(f"sm_{args.arch}, D={args.dim}, {args.dtype}; default config for H={args.heads}: {default}")
    print(
        f"{'BLOCK_H':>7s} {'BLOCK_K':>7s} {'warps':>5s} {'stages':>6s} {'regs':>5s} {'spill B':>8s} {'smem B':>8s} {'fits':>5s} {'wgmma':>6s} {'mma.sync':>8s} {'tcgen05':>7s} {'loop LDL/STL':>12s}"
    )
    for bh, bk, w, st in configs:
        try:
            r = compile_config(args.arch, args.dim, args.dtype, bh, bk, w, st)
            fits = "?" if limit is None else ("yes" if r["smem"] <= limit else "NO")
            note = "" if r["ptxas_error"] is None else "  " + r["ptxas_error"][:80]
            regs, spill = ("?" if r[k] is None else r[k] for k in ("regs", "spill_bytes"))
            print(
                f"{bh:7d} {bk:7d} {w:5d} {st:6d} {regs:>5} {spill:>8} {r['smem']:8d} {fits:>5s} {r['wgmma']:6d} {r['mma_sync']:8d} {r['tcgen05']:7d} {r['loop_spill']:12d}{note}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - e.g. out of resources at compile time
            print(
                f"{bh:7d} {bk:7d} {w:5d} {st:6d}  failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
