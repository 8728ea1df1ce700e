"""The prefill layer call on backend "cpu": one C kernel call per layer, straight from the caches.

Part of `dsv4_torch.prefill`: where the other backends loop over the plan's chunks (gather a
workspace, build index rows, attend), the C kernel (`dsv4_cpu`, `dsv4_prefill_attention`,
through ctypes) reads every token's keys from the caches itself: rows in q's dtype (`PagedKV`,
`LogicalKV`) or fp8_ds_mla pages, dequantized inside the kernel. No
workspace, no chunk loop, no index rows. It takes per token the q row, the batch request (its
block-table row / offsets entry) and the absolute position, built on the host once per step.

A token's result depends only on its own keys in a fixed order (compressed part, then window),
so the output is the same, bit for bit, for every plan of the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4_torch.kernels.cpu import attention as cpu


def step_tokens(step) -> np.ndarray:
    """The fused call's per-token arrays of a step, (3, T) int32 on the host: q row, batch
    request (block-table / offsets row) and absolute position of each of the step's tokens, in
    batch order. Built once per `StepMetadata` (O(tokens) host work, no device read) and kept on
    it (`StepMetadata.cpu_tokens`); every layer kind of the step shares them: the plan does not
    enter the fused call (its `token_request` is a chunk-local slot, not the batch request)."""
    if step.cpu_tokens is None:
        batch = step.step_plan.batch
        tok = np.stack([batch.token_arange, batch.token_request, batch.token_position]).astype(np.int32)
        tok.setflags(write=False)
        step.cpu_tokens = tok
    return step.cpu_tokens


def layer(
    q: torch.Tensor,
    meta,
    raw_kv,
    compressed_kv=None,
    *,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer's output (T, H, d_v) in q's dtype. The arguments are
    `dsv4_torch.prefill.prefill_attention`'s, checked there and its caches as `PagedKV` or
    `LogicalKV` (per-request lists packed there); meta the layer
    kind's `KindMetadata` (only its kind, window, ratio and the step's batch are read)."""
    tok = step_tokens(meta.step)
    if tok.shape[1] != q.shape[0]:
        raise ValueError(f"q: {q.shape[0]} tokens, but the step's batch has {tok.shape[1]}")
    return cpu.prefill_attention(
        q,
        tok,
        raw_kv,
        compressed_kv,
        topk_indices,
        attn_sink,
        kind=meta.kind.name,
        window=meta.plan.window_size,
        compress_ratio=meta.plan.compress_ratio,
        sm_scale=sm_scale,
        out=out,
    )
