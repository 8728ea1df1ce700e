"""Greedy generation with the JAX DeepSeek-V4 model: ragged batched chunked prefill, then decode.

    from dsv4_jax.model.generate import JaxGenerator

    gen = JaxGenerator("path/to/checkpoint", backend="auto", policy="adaptive", dtype="bfloat16")
    gen.generate(["Question: 2 + 3?\nAnswer:"], max_new_tokens=64)          # text in, text out
    gen.generate([[0, 71, 5, ...], [0, 9, ...]], max_new_tokens=256, stop_token_ids=(1,))  # ids
    gen.stats  # {"prefill_tokens": ..., "prefill_seconds": ..., "decode_tokens": ..., ...}

`JaxGenerator(checkpoint_dir, backend="auto"|"xla"|"cpu"|"triton"|..., policy="adaptive"|"fixed"|
"per_request", dtype="float32"|"bfloat16", *, weights="stored"|"dequantized", max_batch_size=8,
max_model_len=4096, max_num_batched_tokens=512, mesh=None, axis=None, kv_cache_dtype="auto")`:
  loads the checkpoint (the official FP8/FP4 release, transformers' or DeepSeek's names; NumPy +
  ml_dtypes, no torch; `dsv4_jax.model.checkpoint`; a DeepSeek-V4.1 checkpoint, either format,
  loads `dsv4_jax.model.v41.DeepseekV41` with `dsv4_jax.model.v41_checkpoint`, and takes its
  keywords `replay=` (False: exact, as transformers; None: vLLM's bounded replay) and
  `fake_quant=` (True: transformers' FP8 / FP4 fake quantization)) and keeps `max_batch_size` cache slots of
  `max_model_len` tokens. `weights="stored"` keeps FP8 / FP4 weights as shipped (dequantized
  inside the matmuls), "dequantized" puts them in `dtype` at load. `mesh` (a
  `jax.sharding.Mesh`) and `axis` split the model over that mesh axis (`dsv4_jax.model.parallel`):
  the weights stream from the files onto their devices. `kv_cache_dtype="fp8_ds_mla"` keeps the
  window and compressed caches as vLLM's fp8 pages (`dsv4_jax.model.fp8_cache`). Other keywords go to
  `dsv4_jax.model.DeepseekV4` (bucket and tile options); token_buckets defaults to "pow2" here
  (one padded tail step per prefill phase, about 4x fewer programs to compile than the 1.25x ladder).
  The checkpoint's `tokenizer.json` (the `tokenizers` package, not transformers) turns text into
  ids and back (`encode`, `decode`; `eos_token_ids` from generation_config.json / config.json).

`generate(prompts, max_new_tokens, stop_token_ids=None) -> list[list[int]] | list[str]`:
  prompts are strings (encoded with the tokenizer's defaults, so with its BOS; the outputs are the
  continuations as text, special tokens skipped) or token-id lists (>= 1 token each; outputs are
  token-id lists); `len(prompt) + max_new_tokens - 1 <= max_model_len`. `stop_token_ids`: None =
  the checkpoint's EOS ids for text prompts and none for token-id prompts.
  Up to `max_batch_size` requests are in flight; the others wait for a free slot. Each step is
  either a prefill step (the pending prompts of the requests in flight, cut into chunks so a step
  holds at most `max_num_batched_tokens` new tokens, ragged: every request its own length) or a
  decode step (one token for every request in flight), both through `DeepseekV4.step`. Greedy:
  the next token is the argmax of the last position's logits. A request stops after
  `max_new_tokens` tokens or on a token of `stop_token_ids` (kept in its output, as
  transformers' `generate` does). Outputs hold the new tokens only, in prompt order.

`stats` (cumulative over calls; `reset_stats()` clears it):
  prefill_tokens, prefill_seconds, prefill_steps / decode_tokens, decode_seconds, decode_steps:
    new tokens, wall seconds (including the host planning and the device-to-host copy of each
    step's next tokens) and steps of each kind;
  compile_seconds: the part of those seconds spent in steps that traced a new program (subtract
    it for steady-state throughput); compiles: `dsv4_jax.model.compile_counts()`;
  chunks_per_step: {"SWA"|"CSA"|"HCA": {"mean", "max"}} attention chunks the planner made per step
    (V4.1: per plan, "SWA/full", "CSA2/full", "CSA1/cut", "CSA1/replay", ...);
  peak_workspace_rows: the largest workspace (rows of 512) any step's plan needed.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsv4_jax.model.model import DeepseekV4, compile_counts
from dsv4_jax.model.v41 import is_v41_checkpoint


@dataclass
class _Request:
    index: int
    prompt: list[int]
    slot: int
    cached: int = 0  # tokens already in the cache
    output: list[int] = field(default_factory=list)


class JaxGenerator:
    """Greedy ragged-batch generation; see the module docstring."""

    def __init__(
        self,
        checkpoint_dir,
        backend: str = "auto",
        policy: str = "adaptive",
        dtype: str = "float32",
        *,
        weights: str = "stored",
        max_batch_size: int = 8,
        max_model_len: int = 4096,
        max_num_batched_tokens: int = 512,
        mesh=None,
        axis=None,
        kv_cache_dtype: str = "auto",
        **model_kwargs,
    ):
        model_kwargs.setdefault("token_buckets", "pow2")  # prefill tails vary; few shapes beat tight padding
        self.checkpoint_dir = Path(checkpoint_dir)
        model_cls = DeepseekV4
        if is_v41_checkpoint(checkpoint_dir):  # DeepSeek-V4.1 (either format): its own model
            from dsv4_jax.model.v41 import DeepseekV41 as model_cls
        elif {"replay", "fake_quant"} & set(model_kwargs):
            raise ValueError(
                f"{sorted({'replay', 'fake_quant'} & set(model_kwargs))}: DeepSeek-V4.1 options, but "
                f"{str(checkpoint_dir)!r} holds a DeepSeek-V4 checkpoint"
            )
        self.model = model_cls.from_checkpoint(
            checkpoint_dir,
            dtype=dtype,
            weights=weights,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            backend=backend,
            policy=policy,
            mesh=mesh,
            axis=axis,
            kv_cache_dtype=kv_cache_dtype,
            **model_kwargs,
        )
        self.config = self.model.config
        self._tokenizer = None
        self.eos_token_ids = _eos_ids(self.checkpoint_dir, self.config.eos_token_id)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache = self.model.init_cache()
        self.last_plan = None  # the planner.StepPlan of the last step
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {
            "prefill_tokens": 0,
            "prefill_seconds": 0.0,
            "prefill_steps": 0,
            "decode_tokens": 0,
            "decode_seconds": 0.0,
            "decode_steps": 0,
            "compile_seconds": 0.0,
            "compiles": compile_counts(),
            "chunks_per_step": {},
            "peak_workspace_rows": 0,
        }
        self._chunks: dict[str, tuple[int, int, int]] = {}  # kind -> (sum, steps, max)

    def _check(self, prompts, max_new_tokens, stop_token_ids):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected a non-negative int, got {max_new_tokens!r}")
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
        V, limit = self.config.vocab_size, self.model.max_model_len
        out = []
        for i, p in enumerate(prompts):
            ids = np.asarray(p)
            if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
                raise ValueError(f"prompts[{i}]: expected a non-empty list of ints, got {p!r:.80}")
            if ids.min() < 0 or ids.max() >= V:
                raise ValueError(
                    f"prompts[{i}]: token ids must be in 0..{V - 1}, got {int(ids.min())}..{int(ids.max())}"
                )
            if ids.size + max(max_new_tokens - 1, 0) > limit:
                raise ValueError(
                    f"prompts[{i}]: {ids.size} tokens + {max_new_tokens} new exceed max_model_len = {limit}"
                )
            out.append([int(t) for t in ids])
        try:
            stops = {int(t) for t in stop_token_ids}
        except (TypeError, ValueError):
            raise TypeError(f"stop_token_ids: expected a sequence of ints, got {stop_token_ids!r}") from None
        return out, stops

    @property
    def tokenizer(self):
        """The checkpoint's `tokenizers.Tokenizer` (tokenizer.json), loaded on first use."""
        if self._tokenizer is None:
            path = self.checkpoint_dir / "tokenizer.json"
            if not path.is_file():
                raise ValueError(
                    f"prompts: text needs a tokenizer, and there is no tokenizer.json in {str(self.checkpoint_dir)!r}"
                )
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with the tokenizer's defaults (its BOS included, as transformers' does)."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, token_ids) -> str:
        """Text of `token_ids`, special tokens skipped."""
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True)

    def generate(self, prompts, max_new_tokens: int, stop_token_ids=None):
        """Greedy continuations of `prompts`: text for text prompts, ids for ids (module docstring)."""
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts):
            ids = [self.encode(p) for p in prompts]
            stops = self.eos_token_ids if stop_token_ids is None else stop_token_ids
            return [self.decode(out) for out in self._generate_ids(ids, max_new_tokens, stops)]
        if isinstance(prompts, (list, tuple)) and any(isinstance(p, str) for p in prompts):
            raise TypeError("prompts: expected all strings or all token-id lists, got a mix")
        return self._generate_ids(prompts, max_new_tokens, () if stop_token_ids is None else stop_token_ids)

    def _generate_ids(self, prompts, max_new_tokens: int, stop_token_ids) -> list[list[int]]:
        prompts, stops = self._check(prompts, max_new_tokens, stop_token_ids)
        results: list[list[int] | None] = [None] * len(prompts)
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        waiting = deque(enumerate(prompts))
        free = deque(range(self.model.max_batch_size))
        active: list[_Request] = []

        def finish(r: _Request, token: int):
            r.output.append(token)
            if token in stops or len(r.output) >= max_new_tokens:
                results[r.index] = r.output
                free.append(r.slot)
                return True
            return False

        while waiting or active:
            while waiting and free:
                i, p = waiting.popleft()
                active.append(_Request(i, p, free.popleft()))
            pending = [r for r in active if r.cached < len(r.prompt)]
            if pending:
                done = set()
                for r, tok in self._prefill_step(pending):
                    if finish(r, tok):
                        done.add(id(r))
            else:  # decode step: the last token of every request in flight
                next_tokens = self._run("decode", active, [[r.output[-1]] for r in active])
                done = set()
                for r, tok in zip(active, next_tokens):
                    r.cached += 1
                    if finish(r, tok):
                        done.add(id(r))
            active = [r for r in active if id(r) not in done]
        return results  # type: ignore[return-value]

    def _prefill_step(self, pending: list[_Request]) -> list[tuple[_Request, int]]:
        """One prefill step: chunks of the pending prompts, ragged, within the token budget.
        Returns (request, next token) for the requests whose prompt is now fully cached."""
        chosen, budget = [], self.max_num_batched_tokens
        for r in pending:
            take = min(len(r.prompt) - r.cached, budget)
            if take == 0:
                break
            chosen.append((r, take))
            budget -= take
        tokens = [r.prompt[r.cached : r.cached + take] for r, take in chosen]
        next_tokens = self._run("prefill", [r for r, _ in chosen], tokens)
        finished = []
        for (r, take), tok in zip(chosen, next_tokens):
            r.cached += take
            if r.cached == len(r.prompt):
                finished.append((r, tok))
        return finished

    def session(self) -> GenerationSession:
        """A step-level view of this generator (what eval/gsm8k.py drives)."""
        return GenerationSession(self)

    def _run(self, phase: str, reqs: list[_Request], tokens: list[list[int]]) -> list[int]:
        before = sum(compile_counts().values())
        t0 = time.perf_counter()
        self.cache, out = self.model.step(self.cache, [r.slot for r in reqs], [r.cached for r in reqs], tokens)
        next_tokens = np.asarray(out.next_tokens)[: len(reqs)].tolist()  # waits for the device
        seconds = time.perf_counter() - t0
        s = self.stats
        s[f"{phase}_tokens"] += sum(len(t) for t in tokens)
        s[f"{phase}_seconds"] += seconds
        s[f"{phase}_steps"] += 1
        if sum(compile_counts().values()) > before:
            s["compile_seconds"] += seconds
        s["compiles"] = compile_counts()
        self.last_plan = out.plan
        s["peak_workspace_rows"] = max(s["peak_workspace_rows"], out.plan.max_workspace_rows)
        if out.plan.schedule is None:  # V4: one plan per kind
            named = [(kind.name, kp) for kind, kp in out.plan.kinds.items()]
        else:  # V4.1: one plan per (ratio, band), e.g. "CSA2/full", "CSA1/replay"
            named = [(str(key), kp) for key, kp in out.plan.plans.items()]
        for name, kp in named:
            total, count, most = self._chunks.get(name, (0, 0, 0))
            self._chunks[name] = (total + kp.num_chunks, count + 1, max(most, kp.num_chunks))
        s["chunks_per_step"] = {k: {"mean": t / c, "max": m} for k, (t, c, m) in self._chunks.items()}
        return next_tokens


def _eos_ids(ckpt: Path, default: int) -> tuple[int, ...]:
    """EOS ids of a checkpoint: generation_config.json and config.json merged (else the config's)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = ckpt / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else (value or []))
    return tuple(sorted(ids)) or (int(default),)


class GenerationSession:
    """Greedy generation driven one step at a time, for callers with their own loop.

        session = JaxGenerator(ckpt).session()
        next_tokens = session.prefill(prompts)      # one greedy token per prompt
        next_tokens = session.decode(next_tokens)   # one more per request, all requests every step

    Request i of the last `prefill` holds cache slot i; `decode` takes one token per request (feed
    anything, e.g. a pad token, to requests the caller has finished with).
    """

    def __init__(self, generator: JaxGenerator):
        self.generator = generator
        self.requests: list[_Request] = []

    def prefill(self, prompts) -> list[int]:
        gen = self.generator
        prompts, _ = gen._check(prompts, 1, ())
        if len(prompts) > gen.model.max_batch_size:
            raise ValueError(f"prompts: {len(prompts)} requests exceed max_batch_size = {gen.model.max_batch_size}")
        self.requests = [_Request(i, p, slot=i) for i, p in enumerate(prompts)]
        next_tokens = [0] * len(prompts)
        pending = list(self.requests)
        while pending:
            for r, tok in gen._prefill_step(pending):
                next_tokens[r.index] = tok
            pending = [r for r in pending if r.cached < len(r.prompt)]
        return next_tokens

    def decode(self, tokens) -> list[int]:
        if len(tokens) != len(self.requests):
            raise ValueError(f"tokens: {len(tokens)} tokens for {len(self.requests)} requests of the last prefill")
        limit = self.generator.model.max_model_len
        if any(r.cached + 1 > limit for r in self.requests):
            raise ValueError(f"tokens: a request would exceed max_model_len = {limit}")
        out = self.generator._run("decode", self.requests, [[int(t)] for t in tokens])
        for r in self.requests:
            r.cached += 1
        return out

    def end_session(self) -> None:
        self.requests = []

    def last_step_plan(self):
        return self.generator.last_plan
