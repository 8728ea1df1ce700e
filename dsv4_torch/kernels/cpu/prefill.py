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


def plan_tokens(meta) -> np.ndarray:
    """The fused call's per-token arrays of one plan's metadata: `step_tokens` when the plan's
    rows are the step's tokens and no request has a window floor (every V4 step); else (a
    DeepSeek-V4.1 band's rows, numbered as the band's q rows, or a batch with `replay_start`)
    (4, T_rows) int32: q row, batch request, position and each token's lowest window position
    (`PrefillBatch.window_floor`: the band's window starts). Built once per metadata, kept on it."""
    batch = meta.plan.batch
    if batch is meta.step.step_plan.batch and batch.replay_start is None:
        return step_tokens(meta.step)
    tok = meta.__dict__.get("_cpu_tokens")
    if tok is None:
        rows = [batch.token_arange, batch.token_request, batch.token_position]
        if batch.replay_start is not None:
            rows.append(np.asarray(batch.replay_start, np.int64)[batch.token_request])
        tok = np.stack(rows).astype(np.int32)
        tok.setflags(write=False)
        meta.__dict__["_cpu_tokens"] = tok
    return tok


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
    kind's `KindMetadata` (only its kind, window, ratio and its plan's batch are read)."""
    tok = plan_tokens(meta)
    if tok.shape[1] != q.shape[0]:
        raise ValueError(f"q: {q.shape[0]} tokens, but the layer's rows are {tok.shape[1]}")
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
