"""The GSM8K evaluation's model adapters and `load_generator` (the interface and the greedy driver:
`eval.generator_base`; vLLM's adapter: `eval.vllm_generator`).

- `TorchEvalGenerator`: transformers' `DeepseekV4ForCausalLM` from a checkpoint directory, either
  with its own eager attention (`backend="eager"`) or (default, `backend="auto"` or a named
  backend) after `dsv4_torch.hf.enable_sparse_prefill(model, backend=..., policy=...)`.
- `JaxEvalGenerator`: an adapter over the JAX model (`dsv4_jax.model.generate.JaxGenerator`).
"""

from __future__ import annotations

import functools

from eval.generator_base import (
    Generator,
    SetupError,
    TextCodec,
    check_choices,
    framework_backends,
    resolve_batching,
)
from eval.vllm_generator import VllmEvalGenerator

# ----------------------------------------------------------------------------- torch / transformers


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
        check_choices(backend, policy, dtype, "torch", framework_backends("torch"))
        batching = resolve_batching(batching, backend)  # fail before loading anything
        import torch
        from transformers import DeepseekV4ForCausalLM

        from dsv4_torch.devices import warn_emulated_bf16_gemm

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        warn_emulated_bf16_gemm(getattr(torch, dtype), device, "the eval's transformers model")
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

        from dsv4_torch.devices import emulated_bf16_gemm

        return {
            **super().describe(),
            "framework": "torch",
            "backend": self.backend,
            "policy": self.policy,
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "device": str(self.device),
            # bf16 on a CPU without bf16 dot products: torch's matmuls are emulated (hundreds of times slower)
            "bf16_gemm_emulated": emulated_bf16_gemm(next(self.model.parameters()).dtype, self.device),
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
        check_choices(backend, policy, dtype, "jax", framework_backends("jax"))
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

        from dsv4_cpu.binding import bf16_matmul_native

        cpu = jax.devices()[0].platform == "cpu"
        return {
            **super().describe(),
            "framework": "jax",
            "backend": self.backend,
            "policy": self.policy,
            "dtype": self.dtype,
            "device": str(jax.devices()[0]),
            # bf16 on a CPU without bf16 dot products: XLA's dots are emulated (hundreds of times slower)
            "bf16_gemm_emulated": self.dtype == "bfloat16" and cpu and not bf16_matmul_native(),
            "jax": jax.__version__,
        }


def _is_v41(checkpoint) -> bool:
    import json
    from pathlib import Path

    from planner.contract import is_v41_config

    path = Path(checkpoint) / "config.json"
    try:
        return path.is_file() and is_v41_config(json.loads(path.read_text()))
    except ValueError:  # unreadable config.json: the loaders say what is wrong with it
        return False


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
    """The generator for one configuration (see `TorchEvalGenerator` / `JaxEvalGenerator`).
    A DeepSeek-V4.1 checkpoint runs on the JAX model only (so far)."""
    if framework != "jax" and _is_v41(checkpoint):
        raise ValueError(
            f"framework: {str(checkpoint)!r} holds a DeepSeek-V4.1 checkpoint, which runs with framework='jax' "
            f"(--framework jax) for now, got {framework!r}"
        )
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
