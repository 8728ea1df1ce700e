"""Offline Triton compiles and ptxas' resource report, no GPU needed (the `triton` wheel only).

The wheel compiles for any CUDA target (`GPUTarget("cuda", 90, 32)`) and ships ptxas, so a CPU
machine can read what a kernel costs on a GPU: registers per thread, spill bytes, shared memory,
which tensor-core instructions the dots became. Used by `tests/jax/test_sparse_attention.py`,
`bench/checks/triton_resources_jax.py` (Triton IR that Pallas emits, from `tools.aot.triton_ir`) and
`bench/checks/triton_resources_torch.py` (our Triton kernel).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import warnings

# ptxas-blackwell first: it is the newer one and reads the PTX versions recent Triton emits.
PTXAS = ("ptxas-blackwell", "ptxas")


def triton_bin_dir() -> str:
    """The wheel's CUDA tools (ptxas, nvdisasm)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def parse_ptxas_report(text: str) -> dict:
    """`ptxas -v` output -> {"regs": registers per thread, "spill_bytes": spill stores} (None
    where the report has no such line)."""
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {"regs": int(regs.group(1)) if regs else None, "spill_bytes": int(spills.group(1)) if spills else None}


def ptxas_stats(ptx: str, arch: int) -> dict:
    """Assemble `ptx` with the wheel's ptxas -v for the PTX's own `.target` (sm_{arch} without one).

    Returns `parse_ptxas_report`'s fields and "ptxas_error": None, or the last line ptxas
    printed when every ptxas the wheel has failed.
    """
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M)  # e.g. sm_90a: assemble for exactly that
    gpu_name = target.group(1) if target else f"sm_{arch}"
    bindir = triton_bin_dir()
    error = f"no ptxas in {bindir}"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        for exe in PTXAS:
            path = os.path.join(bindir, exe)
            if not os.path.exists(path):
                continue
            res = subprocess.run(
                [path, "-v", f"--gpu-name={gpu_name}", src, "-o", os.path.join(d, "k.cubin")],
                capture_output=True,
                text=True,
            )
            text = res.stdout + res.stderr
            if res.returncode == 0:
                return {**parse_ptxas_report(text), "ptxas_error": None}
            error = text.strip().splitlines()[-1] if text.strip() else f"{exe} failed (exit {res.returncode})"
    return {"regs": None, "spill_bytes": None, "ptxas_error": error}


def compile_ttir(ir_text: str, num_warps: int, num_stages: int, arch: int) -> dict:
    """Compile Triton IR text with the wheel for sm_{arch}; resources of the result.

    Returns shared_kb, regs, spill_bytes, ptxas_error (see `ptxas_stats`) and whether the PTX
    has wgmma, mma.sync and cp.async instructions.
    """
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
    return {
        "shared_kb": kernel.metadata.shared / 1024,
        **ptxas_stats(ptx, arch),
        "wgmma": "wgmma" in ptx,
        "mma_sync": "mma.sync" in ptx,
        "cp_async": "cp.async" in ptx,
    }
