"""Teacher-forced logprobs of our JAX model and of transformers + our sparse prefill (main venv).

    python -m tests.vllm_cpu.reference_run SPEC.json OUT.json

SPEC: {"checkpoint": dir, "sequences": [[ids]...], "runs": [{"name": ..., "framework": "jax"|"hf",
"dtype": "float32"|"bfloat16", "kv_cache_dtype": "auto"|"fp8_ds_mla"}, ...]}. For every run and
sequence, one full-sequence forward (all logits): at each position i >= 1 the logprob of token
i, the argmax after position i - 1 and the top-1 / top-2 logprobs (what engine_run saves for vLLM).
Runs in the main venv (transformers 5.23, jax); the vllm-cpu venv pins transformers < 5.20.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def _rows(logits: np.ndarray, seq: list[int]) -> dict:
    lg = np.asarray(logits, np.float64)[: len(seq) - 1]
    lp = lg - lg.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    nxt = np.asarray(seq[1:])
    top2 = np.sort(lp, axis=-1)[:, -2:]
    return {
        "logprob": lp[np.arange(len(nxt)), nxt].tolist(),
        "top1": lp.argmax(-1).tolist(),
        "top1_logprob": top2[:, 1].tolist(),
        "top2_logprob": top2[:, 0].tolist(),
    }


def jax_logits(checkpoint: str, seqs: list[list[int]], dtype: str, kv_cache_dtype: str) -> list[np.ndarray]:
    from dsv4_jax.model import DeepseekV4

    longest = max(len(s) for s in seqs)
    m = DeepseekV4.from_checkpoint(
        checkpoint,
        dtype=dtype,
        max_batch_size=len(seqs),
        max_model_len=max(4096, longest),
        max_num_batched_tokens=longest,
        token_buckets="pow2",
        kv_cache_dtype=kv_cache_dtype,
    )
    out = []
    for i, s in enumerate(seqs):  # one request per step: no padding interplay between sequences
        _, o = m.step(m.init_cache(), [i], [0], [s], all_tokens=True)
        out.append(np.asarray(o.request_logits()[0], np.float32))
    return out


def hf_logits(checkpoint: str, seqs: list[list[int]], dtype: str, kv_cache_dtype: str) -> list[np.ndarray]:
    import torch
    import transformers

    from dsv4_torch.hf import enable_sparse_prefill

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=dt).to(dt).eval()
    enable_sparse_prefill(model, kv_cache_dtype=kv_cache_dtype)
    out = []
    with torch.no_grad():
        for s in seqs:
            out.append(model(torch.tensor([s]), use_cache=True).logits[0].float().numpy())
    return out


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    seqs = spec["sequences"]
    result = {}
    for run in spec["runs"]:
        t = time.perf_counter()
        fn = {"jax": jax_logits, "hf": hf_logits}[run["framework"]]
        logits = fn(spec["checkpoint"], seqs, run["dtype"], run.get("kv_cache_dtype", "auto"))
        result[run["name"]] = {
            "requests": [_rows(lg, s) for lg, s in zip(logits, seqs)],
            "seconds": time.perf_counter() - t,
        }
        print(run["name"], f"{time.perf_counter() - t:.1f}s", flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
