"""Greedy generators for the GSM8K evaluation: one small interface, one driver, thin model adapters.

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

import functools
import json
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from planner.contract import BACKENDS, POLICIES

BATCHING = ("auto", "per_request", "batched")
# `backend=` per framework: "eager" is transformers' own attention; the rest are our kernels
TORCH_BACKENDS = ("eager", "auto") + BACKENDS["torch"]
JAX_BACKENDS = ("auto", "xla", "cpu", "pallas")  # "cpu": the C kernel; "pallas": Triton on a GPU, interpreted elsewhere
# vLLM's CPU engine with our plugin: "auto" / "dsv4" = prefill attention through our CPU kernel,
# "vllm" = vLLM's own flash_mla_with_kvcache_cpu (DSV4_PREFILL_VLLM_CPU_PREFILL)
VLLM_BACKENDS = ("auto", "dsv4", "vllm")
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
    """Chunks per layer kind and peak workspace rows of a step's plan.

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
        _check_prompts(prompts)
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


def _check_prompts(prompts) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts: expected a non-empty list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompts[{i}]: expected a non-empty list of token ids, got {p!r:.80}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise ValueError(f"prompts[{i}]: token ids must be non-negative ints, got {list(p)[:8]!r}...")


# ----------------------------------------------------------------------------- torch / transformers


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


def _check_choices(backend: str, policy: str, dtype: str, framework: str, backends: tuple) -> None:
    if backend not in backends:
        raise ValueError(f"backend: for framework={framework!r} expected one of {backends}, got {backend!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")


class TorchEvalGenerator(Generator):
    """transformers' `DeepseekV4ForCausalLM`; eager attention or our sparse prefill (issue 6).

    Per request: `model(input_ids[1, L], past_key_values=DynamicCache(config))`, then one token per
    call. Batched: left-padded `input_ids[B, L]`, `attention_mask[B, L]` (0 on padding) and
    `position_ids = cumsum(mask) - 1`, the mask grown by one column per decode step; correct only
    if the attention honours per-request lengths (our integration's contract, not eager's).
    """

    def __init__(
        self, model, codec, *, backend: str = "auto", policy: str | None = None, batching: str = "auto", plan_hook=None
    ):
        super().__init__()
        import torch

        self._torch = torch
        self.model = model.eval()
        self.codec = codec
        self.backend = backend
        self.policy = policy
        self.batching = resolve_batching(batching, backend)
        self.plan_hook = plan_hook
        self.device = next(model.parameters()).device
        self._cache = self._mask = self._next_pos = None

    @classmethod
    def from_checkpoint(
        cls, checkpoint, *, backend="auto", policy="adaptive", dtype="float32", device=None, batching="auto"
    ) -> TorchEvalGenerator:
        """Load model and tokenizer from `checkpoint`; route attention through our path unless eager.

        backend: "eager" (transformers' own) or a backend of `dsv4_torch.hf.enable_sparse_prefill`
          ("auto", "reference", "triton", "flashmla"). policy: "adaptive", "fixed" or "per_request"
          (not used by eager). dtype: "float32" or "bfloat16". device: default cuda if available.
        """
        _check_choices(backend, policy, dtype, "torch", TORCH_BACKENDS)
        batching = resolve_batching(batching, backend)  # fail before loading anything
        import torch
        from transformers import DeepseekV4ForCausalLM

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = DeepseekV4ForCausalLM.from_pretrained(
            str(checkpoint), dtype=getattr(torch, dtype), attn_implementation="eager"
        ).to(device)
        plan_hook = None
        if backend != "eager":
            from dsv4_torch import hf

            hf.enable_sparse_prefill(model, backend=backend, policy=policy)
            plan_hook = functools.partial(hf.last_step_plan, model)
        return cls(
            model,
            TextCodec.from_checkpoint(checkpoint),
            backend=backend,
            policy=None if backend == "eager" else policy,
            batching=batching,
            plan_hook=plan_hook,
        )

    def prefill(self, prompts):
        torch = self._torch
        from transformers import DynamicCache

        longest = max(map(len, prompts))
        ids = torch.full((len(prompts), longest), self.codec.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        self._cache = DynamicCache(config=self.model.config)
        kwargs = {}
        if self.batching == "batched":
            self._mask = mask.to(self.device)
            kwargs = dict(attention_mask=self._mask, position_ids=(self._mask.cumsum(-1) - 1).clamp(min=0))
            self._next_pos = self._mask.sum(-1, keepdim=True)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(self.device), past_key_values=self._cache, use_cache=True, logits_to_keep=1, **kwargs
            )
        return out.logits[:, -1].argmax(-1).tolist()

    def decode(self, tokens):
        torch = self._torch
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, 1)
        kwargs = {}
        if self.batching == "batched":
            self._mask = torch.cat([self._mask, self._mask.new_ones((len(tokens), 1))], dim=1)
            kwargs = dict(attention_mask=self._mask, position_ids=self._next_pos)
            self._next_pos = self._next_pos + 1
        with torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=self._cache, use_cache=True, **kwargs)
        return out.logits[:, -1].argmax(-1).tolist()

    def end_session(self):
        self._cache = self._mask = self._next_pos = None

    def last_plan(self):
        return self.plan_hook() if self.plan_hook is not None else None

    def describe(self):
        import torch
        import transformers

        return {
            **super().describe(),
            "framework": "torch",
            "backend": self.backend,
            "policy": self.policy,
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "device": str(self.device),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "plan_hook": self.plan_hook is not None,
            "backends": self._backends_run(),
        }

    def _backends_run(self):
        """The concrete kernel per layer kind of the last forward (our path only), e.g. {"CSA": "triton"}."""
        if self.backend == "eager":
            return None
        from dsv4_torch import hf

        record = hf.last_forward(self.model)
        return None if record is None else record.backends


# ----------------------------------------------------------------------------- JAX (issue 7)


class JaxEvalGenerator(Generator):
    """Adapter over the JAX DeepSeek-V4 model (`dsv4_jax.model.generate.JaxGenerator(...).session()`):

    session.prefill(prompts: list[list[int]]) -> list[int]   # greedy next token per request
    session.decode(tokens: list[int]) -> list[int]
    session.end_session()
    session.last_step_plan() -> planner.StepPlan | None     # planner figures
    """

    def __init__(self, session, codec, *, backend, policy, dtype, batching="batched"):
        super().__init__()
        self.session, self.codec = session, codec
        self.backend, self.policy, self.dtype = backend, policy, dtype
        self.batching = resolve_batching(batching, backend)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint,
        *,
        backend="auto",
        policy="adaptive",
        dtype="float32",
        batching="auto",
        max_batch_size=8,
        max_model_len=8192,
    ) -> JaxEvalGenerator:
        _check_choices(backend, policy, dtype, "jax", JAX_BACKENDS)
        try:
            from dsv4_jax.model.generate import JaxGenerator
        except ModuleNotFoundError as e:
            raise SetupError(f"--framework jax needs JAX and dsv4_jax.model.generate ({e})") from None
        session = JaxGenerator(
            str(checkpoint),
            backend=backend,
            policy=policy,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
        ).session()
        return cls(
            session,
            TextCodec.from_checkpoint(checkpoint),
            backend=backend,
            policy=policy,
            dtype=dtype,
            batching=batching,
        )

    def prefill(self, prompts):
        return [int(t) for t in self.session.prefill(prompts)]

    def decode(self, tokens):
        return [int(t) for t in self.session.decode(tokens)]

    def end_session(self):
        if callable(getattr(self.session, "end_session", None)):
            self.session.end_session()

    def last_plan(self):
        hook = getattr(self.session, "last_step_plan", None)
        return hook() if callable(hook) else None

    def describe(self):
        import jax

        return {
            **super().describe(),
            "framework": "jax",
            "backend": self.backend,
            "policy": self.policy,
            "dtype": self.dtype,
            "device": str(jax.devices()[0]),
            "jax": jax.__version__,
        }


# ----------------------------------------------------------------------------- vLLM (CPU engine)


class VllmEvalGenerator(Generator):
    """vLLM's offline API (`vllm.LLM(...).generate`, greedy) on vLLM's CPU engine with our plugin.

    vLLM runs its own scheduler (continuous batching, chunked prefill), so this adapter replaces
    the session driver: one `LLM.generate` per `generate` call, stopping at the same stop strings
    and EOS ids (the scored text is cut at the first stop string either way). `steps` gets one
    prefill and one decode record per call, timed from vLLM's per-request timestamps.
    """

    batching = "batched"

    def __init__(self, llm, codec, *, backend: str, dtype: str):
        super().__init__()
        self.llm, self.codec, self.backend, self.dtype = llm, codec, backend, dtype

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint,
        *,
        backend="auto",
        dtype="bfloat16",
        batch_size=8,
        max_model_len=8192,
        max_num_batched_tokens=4096,
    ) -> VllmEvalGenerator:
        if backend not in VLLM_BACKENDS:
            raise ValueError(f"backend: for framework='vllm' expected one of {VLLM_BACKENDS}, got {backend!r}")
        if dtype != "bfloat16":
            raise ValueError(f"dtype: vLLM's CPU DeepSeek-V4 path computes in bfloat16, got {dtype!r}")
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        try:
            from vllm import LLM

            from dsv4_torch.vllm import cpu_engine
        except ModuleNotFoundError as e:
            raise SetupError(f"--framework vllm needs vllm-cpu 0.32.0 and dsv4-prefill[vllm-cpu] ({e})") from None
        os.environ[cpu_engine.PREFILL_ENV] = "vllm" if backend == "vllm" else "dsv4"
        llm = LLM(
            model=str(checkpoint),
            dtype="bfloat16",
            max_model_len=max_model_len,
            max_num_seqs=batch_size,
            max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=True,
            seed=0,
            disable_log_stats=False,
        )
        return cls(llm, TextCodec.from_checkpoint(checkpoint), backend=backend, dtype=dtype)

    def prefill(self, prompts):  # vLLM schedules its own steps: see generate
        raise NotImplementedError("VllmEvalGenerator runs whole requests through vLLM's scheduler (generate)")

    def decode(self, tokens):
        raise NotImplementedError("VllmEvalGenerator runs whole requests through vLLM's scheduler (generate)")

    def generate(self, prompts, max_new_tokens, stop_strings):
        from vllm import SamplingParams

        _check_prompts(prompts)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
        StopCriteria(self.codec, stop_strings)  # same argument checks
        sp = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=0.0,
            stop=[s for s in stop_strings if s] or None,
            stop_token_ids=sorted(self.codec.eos_token_ids),
        )
        start = time.perf_counter()
        results = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - start
        outputs = [list(r.outputs[0].token_ids) for r in results]
        m = [r.metrics for r in results]
        if all(x is not None and x.first_token_ts > 0 for x in m):
            t0 = min(x.scheduled_ts for x in m)
            first = max(x.first_token_ts for x in m)
            prefill_s, decode_s = first - t0, max(max(x.last_token_ts for x in m) - first, 0.0)
        else:
            prefill_s, decode_s = wall, 0.0
        n = len(prompts)
        self.steps.append(StepStats("prefill", n, sum(map(len, prompts)), prefill_s))
        self.steps.append(StepStats("decode", n, sum(max(len(o) - 1, 0) for o in outputs), decode_s))
        return outputs

    def describe(self):
        import vllm

        from dsv4_torch.vllm import cpu_engine, plugin

        return {
            **super().describe(),
            "framework": "vllm",
            "backend": self.backend,
            "dtype": self.dtype,
            "vllm": getattr(vllm, "__version__", None),
            "plugin_active": plugin._registered,
            "prefill_kernel": os.environ.get(cpu_engine.PREFILL_ENV),
            "plugin_stats": dict(cpu_engine.STATS),
        }


def load_generator(
    checkpoint,
    *,
    framework="torch",
    backend="auto",
    policy="adaptive",
    dtype="float32",
    device=None,
    batching="auto",
    batch_size=8,
) -> Generator:
    """The generator for one configuration (see `TorchEvalGenerator` / `JaxEvalGenerator`)."""
    if framework == "torch":
        return TorchEvalGenerator.from_checkpoint(
            checkpoint, backend=backend, policy=policy, dtype=dtype, device=device, batching=batching
        )
    if framework == "jax":
        if device is not None:
            raise ValueError(
                f"device: not supported for framework='jax' (JAX picks its default device), got {device!r}"
            )
        return JaxEvalGenerator.from_checkpoint(
            checkpoint, backend=backend, policy=policy, dtype=dtype, batching=batching, max_batch_size=batch_size
        )
    if framework == "vllm":
        if device not in (None, "cpu"):
            raise ValueError(f"device: framework='vllm' runs vLLM's CPU engine, got {device!r}")
        return VllmEvalGenerator.from_checkpoint(checkpoint, backend=backend, dtype=dtype, batch_size=batch_size)
    raise ValueError(f"framework: expected 'torch', 'jax' or 'vllm', got {framework!r}")
