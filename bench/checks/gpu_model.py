"""GPU check of the JAX model on real-format weights: one V4-Flash-sized layer on one GPU.

    python -m bench.checks.gpu_model [--tokens 4096]
    python -m bench.checks.gpu_model --dry-run     # the same steps on CPU at a tiny size

`check_flash_layer()`: writes one V4-Flash-sized CSA layer (hidden 4096, 64 heads of 512, FP8
attention projections with E8M0 128x128 scales, 256 FP4 routed experts of width 2048, top-6,
BF16 compressors; a 4096-token vocabulary so the layer dominates) in the official release
format from random values (`tools.official_checkpoint.write_random_checkpoint`, ~3.5 GB, to a
temporary directory, deleted after), loads it onto the first device with the weights as shipped
(FP8 / FP4 on the device), and runs a prefill step of `--tokens` tokens twice (the first
compiles). Prints the load time, the device bytes (and the device's peak memory when it reports
one), and the tokens/s of the second step. Every stage is guarded: a failure prints and the
script exits 0. Without a GPU (and without --dry-run) it says so and exits.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback

START = time.time()


def _say(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def check_flash_layer(dry_run: bool = False, tokens: int = 4096) -> dict:
    """Write, load and run one V4-Flash-sized layer (module docstring); returns the figures."""
    import jax
    import numpy as np

    from dsv4_jax.model import DeepseekV4, ModelConfig, parallel
    from dsv4_jax.model.checkpoint import load_checkpoint
    from dsv4_jax.model.safetensors_io import file_bytes
    from tools.official_checkpoint import flash_like_config, write_random_checkpoint

    if dry_run:
        from tools.tiny_checkpoint import tiny_config

        cfg_json = tiny_config(compress_ratios=(4,), num_hash_layers=0)
        tokens = min(tokens, 64)
    else:
        cfg_json = flash_like_config(compress_ratios=(4,), n_routed_experts=256, vocab_size=4096)
    figures = {"tokens": tokens}
    tmp = tempfile.mkdtemp(prefix="dsv4-gpu-check-model-")
    try:
        t0 = time.perf_counter()
        write_random_checkpoint(tmp, cfg_json)
        figures["checkpoint_bytes"] = file_bytes(tmp)
        _say(
            f"wrote {figures['checkpoint_bytes'] / 1e9:.2f} GB (official format, random) in {time.perf_counter() - t0:.1f} s"
        )
        dev = jax.devices()[0]
        t0 = time.perf_counter()
        cfg, params = load_checkpoint(tmp, dtype="bfloat16")
        jax.block_until_ready(params)
        figures["load_seconds"] = time.perf_counter() - t0
        figures["device_bytes"] = sum(parallel.device_bytes(params).values())
        _say(
            f"loaded onto {dev} in {figures['load_seconds']:.1f} s: {figures['device_bytes'] / 1e9:.2f} GB on the device "
            f"(FP8 / FP4 as shipped; {cfg.n_routed_experts} experts)"
        )
        assert cfg == ModelConfig.from_checkpoint(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    model = DeepseekV4(
        cfg,
        params,
        dtype="bfloat16",
        max_batch_size=1,
        max_model_len=tokens,
        max_num_batched_tokens=tokens,
        token_buckets="pow2",
    )
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, tokens).tolist()
    for run in ("compile + run", "run"):
        t0 = time.perf_counter()
        _, out = model.step(model.init_cache(), [0], [0], [ids])
        logits = np.asarray(out.logits)
        seconds = time.perf_counter() - t0
        _say(
            f"prefill step of {tokens} tokens ({run}): {seconds:.3f} s, {tokens / seconds:,.0f} tokens/s, "
            f"logits finite: {bool(np.isfinite(logits).all())}"
        )
    figures["step_seconds"] = seconds
    figures["tokens_per_s"] = tokens / seconds
    stats = getattr(dev, "memory_stats", lambda: None)()
    if stats and "peak_bytes_in_use" in stats:
        figures["peak_device_bytes"] = stats["peak_bytes_in_use"]
        _say(f"device peak memory {stats['peak_bytes_in_use'] / 1e9:.2f} GB")
    return figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="the same steps on CPU with a tiny layer (or DSV4_GPU_CHECK_DRY_RUN=1)"
    )
    ap.add_argument("--tokens", type=int, default=4096, help="prefill tokens per step")
    args = ap.parse_args(argv)
    dry = args.dry_run or bool(os.environ.get("DSV4_GPU_CHECK_DRY_RUN"))
    tokens = args.tokens
    if not dry:
        try:
            import jax

            if jax.devices()[0].platform != "gpu":
                print("no GPU: nothing to check (use --dry-run for the CPU rehearsal)")
                return 0
        except Exception:
            traceback.print_exc(limit=2)
            return 0
    print(f"== one V4-Flash-sized layer, official format, {'dry run (CPU, tiny)' if dry else 'GPU'}", flush=True)
    try:
        figures = check_flash_layer(dry_run=dry, tokens=tokens)
        print("figures:", {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}, flush=True)
    except Exception:
        traceback.print_exc(limit=6)
        print("   -> check FAILED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
