"""Peak host memory of loading an official-format checkpoint into the JAX model.

    python -m bench.bench_jax_load [--layers 0,4,128] [--experts 8] [--vocab 129280]
                                   [--weights stored|dequantized] [--devices N] [--out DIR] [--keep]

Writes a checkpoint with V4-Flash's geometry (hidden 4096, 64 heads of 512, FP8 attention
projections, FP4 routed experts of width 2048, BF16 embed/head over the real 129280-token
vocabulary) but few layers and experts, so it is 2-3 GB on disk (random values, streamed to disk:
`tools.official_checkpoint.write_random_checkpoint`). Then, in a fresh process, loads it with
`dsv4_jax.model.checkpoint.load_checkpoint` and reads /proc/self/status: the resident set before
the load (after importing JAX), its peak during the load (VmHWM) and after it.

On a CPU "device" the loaded weights live in host memory, so the resident set grows by the
device bytes; what the loader itself costs is the transient `peak - after`, to be compared with
the largest tensor (the streaming loader's bound) and the checkpoint (what staging it would cost).
The checkpoint is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
if int(sys.argv[3]) > 1:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[3]}"
import jax, numpy as np

def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out

from dsv4_jax.model import parallel
from dsv4_jax.model.checkpoint import load_checkpoint
jax.numpy.zeros(1).block_until_ready()  # start the runtime before the baseline
before = status()
mesh = None
if int(sys.argv[3]) > 1:
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()), ("tp",))
t0 = time.perf_counter()
cfg, params = load_checkpoint(sys.argv[1], dtype="bfloat16", weights=sys.argv[2], mesh=mesh)
seconds = time.perf_counter() - t0
after = status()
per_device = parallel.device_bytes(params)
print(json.dumps({"before": before, "after": after, "seconds": seconds,
                  "device_bytes": sum(per_device.values()), "max_device_bytes": max(per_device.values()),
                  "weight_bytes": parallel.weight_bytes(params)}))
"""


def _gb(b) -> str:
    return f"{b / 1e9:.3f} GB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="0,4,128", help="compress ratio of each layer (0 SWA, 4 CSA, 128 HCA)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per layer")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--weights", choices=("stored", "dequantized"), default="stored")
    ap.add_argument("--devices", type=int, default=1, help="simulated CPU devices (> 1: load onto a mesh)")
    ap.add_argument("--out", help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    args = ap.parse_args(argv)

    from dsv4_jax.model.safetensors_io import CheckpointFiles, file_bytes
    from tools.official_checkpoint import flash_like_config, write_random_checkpoint

    ratios = tuple(int(r) for r in args.layers.split(","))
    cfg = flash_like_config(compress_ratios=ratios, n_routed_experts=args.experts, vocab_size=args.vocab)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="dsv4-load-bench-"))
    try:
        t0 = time.perf_counter()
        write_random_checkpoint(out, cfg)
        write_s = time.perf_counter() - t0
        size = file_bytes(out)
        with CheckpointFiles(out) as files:
            largest = max(files.tensors.values(), key=lambda i: i.nbytes)
            largest_expert = max((i.nbytes for n, i in files.tensors.items() if ".experts." in n), default=0)
        env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env.pop("XLA_FLAGS", None)
        p = subprocess.run(
            [sys.executable, "-c", CHILD, str(out), args.weights, str(args.devices)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
        )
        if p.returncode:
            print(p.stdout, p.stderr, file=sys.stderr)
            return p.returncode
        r = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    before, after = r["before"], r["after"]
    peak = after["VmHWM"]
    transient = peak - after["VmRSS"]
    print(
        f"checkpoint: layers {ratios}, {args.experts} experts, vocab {args.vocab}; {_gb(size)} on disk "
        f"(written in {write_s:.1f} s){'' if args.keep else ', deleted'}"
    )
    print(f"largest tensor: {largest.name} {_gb(largest.nbytes)}; largest expert tensor {largest_expert / 1e6:.1f} MB")
    print(
        f"load: weights={args.weights}, bfloat16 compute, {args.devices} device(s), {r['seconds']:.1f} s; "
        f"device bytes {_gb(r['device_bytes'])} (largest device {_gb(r['max_device_bytes'])})"
    )
    print(
        f"resident set: before {_gb(before['VmRSS'])}, peak {_gb(peak)}, after {_gb(after['VmRSS'])} "
        f"(anon {_gb(after['RssAnon'])}, file-backed {_gb(after['RssFile'])})"
    )
    print(f"peak - before = {_gb(peak - before['VmRSS'])} = {(peak - before['VmRSS']) / size:.3f} x checkpoint")
    print(
        f"transient (peak - after) = {_gb(transient)} = {transient / size:.3f} x checkpoint "
        f"= {transient / largest.nbytes:.2f} x largest tensor"
    )
    print("(CPU devices keep the weights in host memory: the 'after' resident set includes the device bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
