"""External reference: transformers 5.23.0's DeepSeek-V4 eager attention against our prefill path.

A tiny random checkpoint (`tools.tiny_checkpoint`: 8 query heads of D = 512, 16 indexer
heads, W = 8, index_topk 8) runs in float64 with eager attention. For one SWA, one CSA and one
HCA layer, `dsv4_torch.hf.capture` records transformers' own query, raw KV, compressed KV, the
indexer's top-k, the sink, and the eager attention output before the inverse RoPE (what our
kernels compute). Our prefill (torch and JAX) recomputes that output from those inputs:

  single call   one 299-token prompt, one step;
  chunked       the same prompt over calls 0:37, 37:211, 211:299 and a decode step 299:300 with a
                cache: transformers keeps a DynamicCache, we keep a cache that each call appends
                its new rows and entries to, so every call reads the history earlier calls wrote
                (rows not written yet are NaN, so a read of one would show).

Rows compare with transformers' eager output as the truth: float64 runs within 1e-10 of it,
float32 runs within 1e-5 (relative to its largest |value|).
"""

from __future__ import annotations

import itertools
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

import planner as P
from tests.parity import backends as B
from tests.parity.cases import DTYPE_TAG
from tests.parity.harness import Row, backend_error, bitwise_agreement, make_cache
from tests.parity.tolerances import compare_out

LAYERS = {"SWA": 1, "CSA": 2, "HCA": 3}  # layer index of each kind in the tiny preset
PROMPT_LEN = 299  # 2 HCA entries, 74 CSA entries; the decode step at 299 completes CSA entry 74
CHUNKS = [(0, 37), (37, 211), (211, 299), (299, 300)]  # boundaries not multiples of 4, 8 or 128
TRUTH = "transformers"
DTYPES = ("float64", "float32")
PADDED_TOKENS = 320  # every call's tokens padded to one JAX bucket: one program per kind
VARIANTS = (("adaptive", "paged"), ("per_request", "logical"))  # one request per call: plans differ in N, M
BLOCK_SIZE = 16


@dataclass
class Call:
    """One forward call of one layer: the capture plus our caches as they stand after the call."""

    kind: str
    capture: object  # dsv4_torch.hf.capture.AttentionCapture
    raw: np.ndarray  # (seq_len_max, D) float64: rows written so far, NaN elsewhere
    comp: np.ndarray | None  # (entries_max, D) float64, same


def capture_calls(seed: int = 0) -> dict[str, dict[str, list[Call]]]:
    """{kind: {"single call": [Call], "chunked prefill": [Call x 4]}} from a fresh tiny model.

    Also checks that the caches we build from each call's new rows hold exactly what
    transformers' cache hands the next call (window rows and compressed entries, bitwise).
    """
    import transformers

    from dsv4_torch.hf.capture import capture_attention_layers
    from tools.tiny_checkpoint import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(f"{tmp}/ckpt", seed=seed)
        # float64 needs the eager experts loop: the default grouped_mm rejects float64
        model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, experts_implementation="eager").double().eval()
    ids = torch.randint(3, model.config.vocab_size, (1, CHUNKS[-1][1]), generator=torch.Generator().manual_seed(seed))
    layers = list(LAYERS.values())
    single, _ = capture_attention_layers(model, ids[:, :PROMPT_LEN], layers)
    cache = transformers.DynamicCache(config=model.config)
    chunked = [
        capture_attention_layers(model, ids[:, a:b], layers, past_key_values=cache, use_cache=True)[0]
        for a, b in CHUNKS
    ]
    out = {}
    for kind, i in LAYERS.items():
        cap = single[i]
        comp = None if cap.compressed_kv is None else cap.compressed_kv.numpy().copy()
        calls = {"single call": [Call(kind, cap, cap.raw_kv().numpy().copy(), comp)], "chunked prefill": []}
        D = cap.query.shape[2]
        r = cap.compress_ratio
        raw = np.full((CHUNKS[-1][1], D), np.nan)
        comp = None if r == 0 else np.full((CHUNKS[-1][1] // r, D), np.nan)
        for (a, b), caps in zip(CHUNKS, chunked):
            cap = caps[i]
            win = cap.window_kv.numpy()
            raw[a:b] = win[-(b - a) :]  # this call's new rows
            if not np.array_equal(raw[cap.window_start : b], win):
                raise AssertionError(
                    f"{kind} call {a}:{b}: transformers' window rows differ from the rows earlier calls wrote"
                )
            if comp is not None:
                entries = cap.compressed_kv.numpy()
                old = ~np.isnan(comp[: entries.shape[0], 0])
                if not np.array_equal(comp[: entries.shape[0]][old], entries[old]):
                    raise AssertionError(f"{kind} call {a}:{b}: compressed entries changed since earlier calls")
                comp[: entries.shape[0]] = entries
            calls["chunked prefill"].append(Call(kind, cap, raw.copy(), None if comp is None else comp.copy()))
        out[kind] = calls
    return out


def _layer_inputs(call: Call, dtype: str, index_topk: int) -> B.LayerInputs:
    cap = call.capture
    dt, dev = B.TORCH_DTYPES[dtype], B.TORCH_DEVICE
    r = cap.compress_ratio
    raw = make_cache([call.raw], BLOCK_SIZE, dt, seed=1)
    comp = None if call.comp is None else make_cache([call.comp], max(1, BLOCK_SIZE // r), dt, seed=2)
    topk = None
    if cap.topk_indices is not None:
        rows = np.full((cap.query_len, index_topk), -1, np.int32)
        rows[:, : cap.topk_indices.shape[1]] = cap.topk_indices.numpy()
        topk = torch.from_numpy(rows).to(dev)
    sink_dtype = torch.float64 if dtype == "float64" else torch.float32
    q = cap.query.contiguous().to(dev, dt)
    return B.LayerInputs(P.LayerSpec(cap.kind, r), q, cap.sink.to(dev, sink_dtype), topk, raw, comp)


def run_hf(calls: dict[str, dict[str, list[Call]]], *, index_topk: int = 8, dtypes=DTYPES, only=None) -> list[Row]:
    """One Row per (kind, call set, dtype): transformers' eager output vs every backend, and pairs."""
    rows = []
    for kind, sets in calls.items():
        for set_name, call_list in sets.items():
            for dtype in dtypes:
                rows.append(_run_set(kind, set_name, call_list, dtype, index_topk, only))
    return rows


def _run_set(kind, set_name, call_list, dtype, index_topk, only) -> Row:
    t0 = time.perf_counter()
    name = f"{kind} · {set_name} · {DTYPE_TAG[dtype]}"
    row = Row(
        "hf", name, [f"calls {[(c.capture.seq_len - c.capture.query_len, c.capture.seq_len) for c in call_list]}"]
    )
    runnable = []
    for be in B.BACKENDS:
        if only is not None and be.name not in only:
            continue
        reason = B.why_not(be, dtype, call_list[0].capture.query.shape[2], tiny=False)
        if reason is None:
            runnable.append(be)
        else:
            row.not_run.setdefault(be.name, set()).add(reason)
    for call in call_list:
        cap = call.capture
        truth = cap.output.numpy()
        layers = {cap.kind: _layer_inputs(call, dtype, index_topk)}
        outputs = {}  # backend -> {variant: out}
        for be in runnable:
            # plans and layouts on the float64 torch reference; one plan elsewhere (the synthetic
            # prefill cases cover the plan invariance of every backend)
            variants = VARIANTS if (be.framework == "torch" and be.reference and dtype == "float64") else VARIANTS[:1]
            tb = time.perf_counter()
            try:
                outputs[be.name] = {v: _run_call(be.name, cap, layers, v, index_topk) for v in variants}
            except Exception as e:
                row.errors.append(backend_error(be.name, f"{name} call {cap.seq_len - cap.query_len}:{cap.seq_len}", e))
                continue
            finally:
                row.backend_seconds[be.name] = row.backend_seconds.get(be.name, 0.0) + time.perf_counter() - tb
            row.ran.add(be.name)
            first = outputs[be.name][variants[0]]
            for v in variants[1:]:
                if be.reference:
                    row.bitwise_required.add(be.name)
                row.invariance.setdefault(be.name, []).append(
                    bitwise_agreement(first, outputs[be.name][v], truth, be.reference, v)
                )
        for b, res in outputs.items():  # transformers against every run of every backend
            for out in res.values():
                row.add_pair(TRUTH, b, compare_out(truth, out, truth, dtype))
        for a, b in itertools.combinations(outputs, 2):  # and every pair of backends, same plan
            row.add_pair(a, b, compare_out(outputs[a][VARIANTS[0]], outputs[b][VARIANTS[0]], truth, dtype))
    row.seconds = time.perf_counter() - t0
    return row.finish()


def _run_call(name: str, cap, layers, variant, index_topk: int) -> np.ndarray:
    """One backend's output for one captured call, as a one-request prefill step."""
    policy, layout = variant
    cfg = P.PlanConfig(
        window_size=cap.window_size, max_model_len=CHUNKS[-1][1], max_num_batched_tokens=PROMPT_LEN, policy=policy
    )
    step = P.plan_step(P.PrefillBatch([cap.seq_len], [cap.query_len]), cfg, [(cap.kind, cap.compress_ratio)])
    out = B.run_prefill(
        name, step, layers, layout, index_topk, cap.sm_scale, jax_meta=dict(padded_tokens=PADDED_TOKENS)
    )
    return out[cap.kind]
