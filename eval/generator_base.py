"""Greedy generators for the GSM8K evaluation: one small interface, one driver (this module), thin
model adapters (`eval.generators`: torch, JAX; `eval.vllm_generator`: vLLM's CPU engine).

    Generator.generate(prompts: list[list[int]], max_new_tokens, stop_strings) -> list[list[int]]

The greedy driver (`Generator.generate`) is shared. A model adapter supplies two calls on a
session of requests, each returning the greedy (argmax) next token of every request:

    prefill(prompts: list[list[int]]) -> list[int]    # starts a session
    decode(tokens: list[int]) -> list[int]            # one token per request of the session

- `TorchEvalGenerator`: transformers' `DeepseekV4ForCausalLM` from a checkpoint directory, either
  with its own eager attention (`backend="eager"`) or (default, `backend="auto"` or a named
  backend) after `dsv4_torch.hf.enable_sparse_prefill(model, backend=..., policy=...)`, whose
  ragged batches need no care here: left padding + `attention_mask` is all it reads.
- `JaxEvalGenerator`: an adapter over the JAX model (`dsv4_jax.model.generate.JaxGenerator`).

`backend` is the attention kernel, `policy` the chunk plan (`planner.POLICIES`); the CLI spells
them `--attention` and `--planner`.

Batching: `"per_request"` runs each prompt alone (batch of one); `"batched"` runs all prompts of
a `generate` call as one session (left-padded with a 2-D `attention_mask` and per-row
`position_ids` in the torch adapter). transformers 5.23's eager DeepSeek-V4 attention gives
different tokens for a left-padded request than for the same request alone (its compressors cut
ratio-4/128 windows from cache position 0, pad tokens included), so eager runs per request; our
sparse path keeps per-request compressor state and runs batched.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from planner.contract import POLICIES

BATCHING = ("auto", "per_request", "batched")
# vLLM's CPU engine with our plugin: "auto" / "dsv4" = prefill attention through our CPU kernel,
# "vllm" = vLLM's own flash_mla_with_kvcache_cpu (DSV4_PREFILL_VLLM_CPU_PREFILL)
VLLM_BACKENDS = ("auto", "dsv4", "vllm")


def framework_backends(framework: str) -> tuple[str, ...]:
    """`backend=` choices of a framework: torch's "eager" (transformers' own attention) and "auto",
    then the kernels of each framework's table (`dsv4_torch.backends`, `dsv4_jax.backends`; read
    here, so only that framework is imported); vLLM's `VLLM_BACKENDS`."""
    if framework == "torch":
        from dsv4_torch.backends import BACKENDS

        return ("eager", "auto") + BACKENDS
    if framework == "jax":
        from dsv4_jax.backends import BACKENDS

        return ("auto",) + BACKENDS
    if framework == "vllm":
        return VLLM_BACKENDS
    return ()


DTYPES = ("float32", "bfloat16")


class SetupError(RuntimeError):
    """A missing piece the user can fix (a module of another issue, a checkpoint, data); the CLI
    prints it without a traceback."""


# ----------------------------------------------------------------------------- text <-> tokens


class TextCodec:
    """A checkpoint's tokenizer, used the way lm-eval's HF model uses it.

    encode: `tokenizer(text)` with the tokenizer's defaults (so a BOS is added iff the tokenizer
    adds one; lm-eval's `add_bos_token=None`). decode: `skip_special_tokens=True` (lm-eval's
    `tok_decode`). `eos_token_ids`: the ids that end a request (generation_config.json, config.json
    and the tokenizer, merged); `eos_text`: the EOS token as text, which lm-eval appends to `until`.
    """

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], pad_token_id: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_text = tokenizer.decode([eos], skip_special_tokens=False) if eos is not None else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path) -> TextCodec:
        """Load `AutoTokenizer` from the directory; EOS/pad ids from its config files."""
        from transformers import AutoTokenizer

        ckpt = Path(checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
        eos: set[int] = set()
        pad = None
        for name in ("generation_config.json", "config.json"):
            path = ckpt / name
            if path.is_file():
                cfg = json.loads(path.read_text())
                value = cfg.get("eos_token_id")
                eos.update([value] if isinstance(value, int) else (value or []))
                pad = pad if pad is not None else cfg.get("pad_token_id")
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        if not eos:
            raise ValueError(f"checkpoint: no eos_token_id in {ckpt} (config.json, generation_config.json, tokenizer)")
        if tokenizer.pad_token_id is not None:
            pad = tokenizer.pad_token_id
        return cls(tokenizer, sorted(eos), pad if pad is not None else min(eos))


class StopCriteria:
    """A request is done when its last token is an EOS id or its decoded text holds a stop string.

    The text is the whole continuation decoded (lm-eval decodes the continuation, then cuts it at
    the first stop string), so a stop string split across tokens is still found.
    """

    def __init__(self, codec, stop_strings: Sequence[str]):
        if isinstance(stop_strings, str) or not all(isinstance(s, str) for s in stop_strings):
            raise TypeError(f"stop_strings: expected a sequence of str, got {stop_strings!r}")
        self.codec = codec
        self.stop_strings = tuple(s for s in stop_strings if s)

    def done(self, tokens: Sequence[int]) -> bool:
        if tokens[-1] in self.codec.eos_token_ids:
            return True
        if not self.stop_strings:
            return False
        text = self.codec.decode(tokens)
        return any(s in text for s in self.stop_strings)


# ----------------------------------------------------------------------------- step statistics


@dataclass
class StepStats:
    """One model call: `phase` "prefill" or "decode", live `requests`, `tokens` computed for them
    (prompt tokens for prefill, one per live request for decode), wall `seconds`, and the plan the
    attention used if the backend reports it (`chunks`: chunks per layer kind; `peak_workspace_rows`:
    the largest workspace of the step), else None."""

    phase: str
    requests: int
    tokens: int
    seconds: float
    chunks: dict | None = None
    peak_workspace_rows: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def plan_figures(plan) -> tuple[dict | None, int | None]:
    """Chunks per layer kind (DeepSeek-V4.1: per plan, "CSA2/full", ...) and peak workspace rows
    of a step's plan.

    plan: a `planner.StepPlan`, anything with a `.step_plan` (e.g. dsv4_torch's step metadata), a
      mapping `{"chunks": {...}, "peak_workspace_rows": int}`, or None (no plan: `(None, None)`).
    """
    if plan is None:
        return None, None
    if isinstance(plan, dict):
        return plan.get("chunks"), plan.get("peak_workspace_rows")
    step = getattr(plan, "step_plan", plan)
    kinds = getattr(step, "kinds", None)
    if kinds is None:
        raise TypeError(
            f"plan: expected a planner.StepPlan, an object with .step_plan, or a dict; got {type(plan).__name__}"
        )
    if getattr(step, "schedule", None) is not None:  # DeepSeek-V4.1: one plan per (ratio, band)
        chunks = {str(key): int(kp.num_chunks) for key, kp in step.plans.items()}
    else:
        chunks = {kind.name: int(kp.num_chunks) for kind, kp in kinds.items()}
    return chunks, int(step.max_workspace_rows)


# ----------------------------------------------------------------------------- the greedy driver


class Generator(ABC):
    """Greedy generation over a model session; subclasses implement `prefill` and `decode`.

    Attributes: `codec` (a `TextCodec` or anything with `decode`, `eos_token_ids`, `pad_token_id`),
    `batching` ("per_request" or "batched"), `steps` (a `StepStats` per model call, appended by
    `generate`).
    """

    codec: TextCodec
    batching: str = "per_request"

    def __init__(self):
        self.steps: list[StepStats] = []

    @abstractmethod
    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Start a session with these prompts; return each request's greedy next token."""

    @abstractmethod
    def decode(self, tokens: list[int]) -> list[int]:
        """Feed one token per request of the session; return each request's greedy next token."""

    def end_session(self) -> None:
        """Drop the session's caches (called after each session)."""

    def last_plan(self):
        """The plan the attention used in the last call (see `plan_figures`), or None."""
        return None

    def describe(self) -> dict:
        """What ran, for the report."""
        return {"generator": type(self).__name__, "batching": self.batching}

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_strings: Sequence[str]) -> list[list[int]]:
        """Greedy continuations: for each prompt, the generated token ids, ending with the token that
        completed a stop string or an EOS id, or after `max_new_tokens` tokens.

        prompts: token ids per request, each non-empty. Requests never influence each other's tokens
        (per request: by construction; batched: if the backend handles ragged batches correctly).
        """
        check_prompts(prompts)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
        stop = StopCriteria(self.codec, stop_strings)
        outputs: list[list[int]] = [[] for _ in prompts]
        if self.batching == "per_request":
            sessions = [[i] for i in range(len(prompts))]
        elif self.batching == "batched":
            sessions = [list(range(len(prompts)))]
        else:
            raise ValueError(f"batching: expected 'per_request' or 'batched', got {self.batching!r}")
        for session in sessions:
            try:
                self._run_session(session, prompts, outputs, max_new_tokens, stop)
            finally:
                self.end_session()
        return outputs

    def _run_session(self, session, prompts, outputs, max_new_tokens, stop) -> None:
        batch = [prompts[i] for i in session]
        next_tokens = self._timed("prefill", len(batch), sum(map(len, batch)), self.prefill, batch)
        live = set(range(len(session)))
        while True:
            for j in sorted(live):
                out = outputs[session[j]]
                out.append(int(next_tokens[j]))
                if len(out) >= max_new_tokens or stop.done(out):
                    live.discard(j)
            if not live:
                return
            # Finished rows of a batched session still take a step (as in transformers' generate): feed pad.
            feed = [int(next_tokens[j]) if j in live else self.codec.pad_token_id for j in range(len(session))]
            next_tokens = self._timed("decode", len(live), len(live), self.decode, feed)

    def _timed(self, phase, requests, tokens, fn, arg):
        start = time.perf_counter()
        result = fn(arg)  # adapters return Python ints, so the device work is finished here
        seconds = time.perf_counter() - start
        if len(result) != len(arg):
            raise RuntimeError(f"{type(self).__name__}.{phase} returned {len(result)} tokens for {len(arg)} requests")
        chunks, peak = plan_figures(self.last_plan())
        self.steps.append(StepStats(phase, requests, tokens, seconds, chunks, peak))
        return result


def check_prompts(prompts) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts: expected a non-empty list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompts[{i}]: expected a non-empty list of token ids, got {p!r:.80}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise ValueError(f"prompts[{i}]: token ids must be non-negative ints, got {list(p)[:8]!r}...")


def resolve_batching(batching: str, backend: str) -> str:
    """`auto` -> per_request for transformers' eager attention, batched for every other backend."""
    if batching not in BATCHING:
        raise ValueError(f"batching: expected one of {BATCHING}, got {batching!r}")
    if batching == "auto":
        return "per_request" if backend == "eager" else "batched"
    if batching == "batched" and backend == "eager":
        raise ValueError(
            "batching='batched' with backend='eager': transformers' eager DeepSeek-V4 attention gives "
            "different tokens for left-padded requests (its compressors count windows from cache position 0, "
            "pad tokens included); use batching='per_request' (the default for eager)"
        )
    return batching


def check_choices(backend: str, policy: str, dtype: str, framework: str, backends: tuple) -> None:
    if backend not in backends:
        raise ValueError(f"backend: for framework={framework!r} expected one of {backends}, got {backend!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
