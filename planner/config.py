"""The engine's limits and planning choices: `PlanConfig`, fixed for a server, reused every step.

Below both the planner (`planner.plan`) and its results (`planner.kind_plan`): a plan records the
config it was made under, and the budget formulas (vLLM's workspace bound, spec section 4) live
with the limits they read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner import contract
from planner.checks import INT32_MAX, as_int
from planner.contract import ORDERS, POLICIES, LayerSpec


@dataclass(frozen=True)
class PlanConfig:
    """Engine limits and planning choices; fixed for a server, reused every step.

    window_size: W, the sliding window (the query itself included).
    max_model_len, max_num_batched_tokens: the engine's limits; they set vLLM's workspace bound.
    prefill_chunk_size: requests per chunk of the old fixed plan (4 in vLLM); also scales the
      adaptive budget, which is exactly the fixed plan's workspace.
    policy: "adaptive" (vLLM's greedy packing), "fixed" (the old plan) or "per_request"
      (one request per chunk, vLLM's batch-invariant mode).
    budget_rows: workspace rows one chunk may use (adaptive and per_request). None = vLLM's bound
      `prefill_chunk_size * (cdiv(max_model_len, r) + W + max_num_batched_tokens)` (the
      cdiv term is 0 for layers without a compressed cache).
    order: "batch" (vLLM-compatible) or "length" (requests sorted by workspace width, which packs
      similar requests together and pads less; the permutation is `KindPlan.order`).
    contiguous: chunks never reach across a `query_len == 0` request: every request of a chunk's
      batch range `[start, end)` has queries. What vLLM's chunk loop needs (it gathers every
      request of the range into workspace slot `request - start`); plans of batches without such
      requests do not change. Batch order only.
    replay: DeepSeek-V4.1's decoder bounded replay, for steps planned from a `planner.Schedule`:
      None (vLLM's default `swa_bounded_replay`): on wherever the schedule allows it; True:
      required (ValueError where `Schedule.replay_off_reason` says it cannot run); False: off,
      the exact computation (every row with full windows at every layer, as transformers
      computes). A step planned from a plain list of layers has no cut: True is refused there.
    """

    window_size: int
    max_model_len: int
    max_num_batched_tokens: int
    prefill_chunk_size: int = 4
    policy: str = "adaptive"
    budget_rows: int | None = None
    order: str = "batch"
    contiguous: bool = False
    replay: bool | None = None

    def __post_init__(self):
        for name in ("window_size", "max_model_len", "max_num_batched_tokens", "prefill_chunk_size"):
            as_int(getattr(self, name), name, minimum=1, maximum=INT32_MAX)
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {self.policy!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order: expected one of {ORDERS}, got {self.order!r}")
        if self.budget_rows is not None:
            as_int(self.budget_rows, "budget_rows", minimum=1, maximum=INT32_MAX)
            if self.policy == "fixed":
                raise ValueError("budget_rows: the fixed plan has its own workspace size; use policy='adaptive'")
        if not isinstance(self.contiguous, (bool, np.bool_)):
            raise ValueError(f"contiguous: expected True or False, got {self.contiguous!r}")
        if self.contiguous and self.order != "batch":
            raise ValueError(f"contiguous: batch ranges need order='batch', got order={self.order!r}")
        if self.replay is not None and not isinstance(self.replay, (bool, np.bool_)):
            raise ValueError(f"replay: expected True, False or None, got {self.replay!r}")

    def max_compressed_len(self, layer: LayerSpec) -> int:
        """Upper bound of compressed rows per request: cdiv(max_model_len, r), 0 without a
        compressed cache."""
        return contract.max_compressed_len(self.max_model_len, layer.compress_ratio, layer.has_compressed)

    def vllm_budget_rows(self, layer: LayerSpec) -> int:
        """vLLM's adaptive workspace bound: exactly the fixed plan's workspace rows."""
        return self.prefill_chunk_size * self.fixed_M(layer)

    def fixed_M(self, layer: LayerSpec) -> int:
        return self.max_compressed_len(layer) + self.window_size + self.max_num_batched_tokens

    def budget(self, layer: LayerSpec) -> int:
        """Rows one chunk may use: `budget_rows`, else vLLM's bound (`vllm_budget_rows`, inlined:
        this runs once per kind per step)."""
        if self.budget_rows is not None:
            return int(self.budget_rows)
        comp = -(-self.max_model_len // layer.compress_ratio) if layer.has_compressed else 0
        return self.prefill_chunk_size * (comp + self.window_size + self.max_num_batched_tokens)
