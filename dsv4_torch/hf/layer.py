"""The patched DeepSeek-V4 attention layer of `dsv4_torch.hf.integration`, one call per layer.

`sparse_layer` is transformers' `DeepseekV4Attention.forward` on a ragged batch: projections and
RoPE as transformers computes them, the raw window and compressed entries kept per request
(`dsv4_torch.hf.ragged`, or fp8_ds_mla pages: `dsv4_torch.hf.fp8_cache`), the indexer's top-k per
request, and the attention by `dsv4_torch.prefill.prefill_attention` from the step's metadata.
`compress` is transformers' compressor math, ragged; `indexer_topk` transformers' indexer
queries and weights, scored and selected by `dsv4_torch.indexer`. Device ops
only: the host planning happened once per forward (`integration._Integration.pre_forward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from dsv4_torch.hf import fp8_cache, ragged
from dsv4_torch.prefill import LogicalKV, PagedKV, StepMetadata, prefill_attention
from planner import LayerKind


class Settings(Protocol):
    """What a patched layer reads of its integration (`dsv4_torch.hf.integration`'s, set once at
    `enable_sparse_prefill`): the per-layer specs, the backends and the cache format."""

    layers: tuple
    backend: str
    indexer_backend: str
    indexer_chunk_elems: int
    kv_cache_dtype: str | None


# ----------------------------------------------------------------------------- per-forward context


@dataclass(eq=False)
class ForwardContext:
    """One forward's plan: host integers, device index tensors, the step metadata, the state."""

    state: ragged.RaggedCacheState
    cache: object
    B: int
    T: int
    num_tokens: int  # real tokens (Tr)
    qsl: np.ndarray  # (B + 1,) token offsets of each request in the packed order
    seq: np.ndarray
    query: np.ndarray
    meta: StepMetadata
    raw: ragged.RawPlan | None  # fp8_ds_mla caches: the raw pages of this call
    window: ragged.WindowPlan | None  # caches in the model's dtype: the window regions
    compress: dict[int, ragged.CompressPlan]
    dev: dict[str, torch.Tensor]  # device index tensors: "window_append", ..., and per ratio "4.usable", ...
    real_index: torch.Tensor | None  # (Tr,) rows of the (B*T) flattening; None = every token is real
    replayable: bool = False  # keep each layer's input state, so a checkpoint can recompute the layer
    layer_inputs: dict = field(default_factory=dict)  # layer_idx -> copy of the LayerState it first saw
    layers_done: set = field(default_factory=set)
    token_request: np.ndarray | None = None  # (Tr,) host: each real token's request (the indexer's)
    token_position: np.ndarray | None = None  # (Tr,) host: its absolute position

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(self.B * self.T, *t.shape[2:])
        return flat if self.real_index is None else flat.index_select(0, self.real_index)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        if self.real_index is None:
            return y.view(self.B, self.T, -1)
        out = y.new_zeros((self.B * self.T, y.shape[-1]))
        out.index_copy_(0, self.real_index, y)
        return out.view(self.B, self.T, -1)


def copy_layer_state(ls: ragged.LayerState) -> ragged.LayerState:
    """A new LayerState holding the same tensors (in a replayable forward the layer code assigns
    new tensors and never edits these in place)."""
    return ragged.LayerState(ls.window, {n: dataclasses.replace(cs) for n, cs in ls.compressors.items()})


# ----------------------------------------------------------------------------- the layer


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` (DeepSeek-V4's interleaved RoPE on the trailing
    2 * cos.shape[-1] channels, in float32), bit for bit, without expanding cos / sin to the full
    rope width: out[2i] = x[2i] cos_i - x[2i+1] sin_i, out[2i+1] = x[2i+1] cos_i + x[2i] sin_i
    (transformers adds (-x[2i+1]) sin_i: the same rounding). With a gradient to compute it is
    transformers' function itself: the backward then rounds and sums as eager's does."""
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

        return apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    R = 2 * cos.shape[-1]
    pairs = x[..., -R:].float().unflatten(-1, (R // 2, 2))
    xe, xo = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((xe * c - xo * s, xo * c + xe * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-R], rotated], dim=-1)


def sparse_layer(
    integ: Settings, ctx: ForwardContext, module, lstate: ragged.LayerState, hidden_states, position_embeddings
):
    cfg = module.config
    if ctx.num_tokens == 0:  # only padding in this call
        return hidden_states.new_zeros((ctx.B, ctx.T, cfg.hidden_size))
    x = ctx.pack(hidden_states)  # (Tr, hidden): the real tokens, request-major
    cos, sin = (ctx.pack(t) for t in position_embeddings[module.rope_layer_type])  # (Tr, R/2)
    Tr, H, D = x.shape[0], module.num_heads, module.head_dim

    q_residual = module.q_a_norm(module.q_a_proj(x))
    q = rope(module.q_b_norm(module.q_b_proj(q_residual).view(Tr, H, D)), cos, sin)  # (Tr, H, D)
    kv = rope(module.kv_norm(module.kv_proj(x))[:, None], cos, sin)[:, 0]  # (Tr, D)

    fp8 = integ.kv_cache_dtype == "fp8_ds_mla"
    if fp8 and kv.requires_grad:
        raise ValueError(
            "kv_cache_dtype: the fp8_ds_mla caches hold bytes, so no gradient reaches the latents through "
            "them; run the model under torch.no_grad() / torch.inference_mode(), or train with kv_cache_dtype='auto'"
        )
    if fp8:
        raw = fp8_cache.raw_kv(lstate, kv, ctx.dev, int(np.minimum(ctx.state.seen, cfg.sliding_window - 1).sum()))
    else:
        raw = LogicalKV(write_window(lstate, kv, ctx), ctx.dev["window_offsets"])

    compressed = topk = None
    comp = module.compressor
    spec = integ.layers[module.layer_idx]
    ratio = spec.compress_ratio
    if spec.has_compressed:
        if comp is None or int(comp.compress_rate) != ratio:
            raise RuntimeError(
                f"layer {module.layer_idx}: a {spec.kind.name} layer of ratio {ratio} without that compressor"
            )
        csa = spec.kind is LayerKind.CSA
        entries = compress(comp, x, lstate, "compressor", ctx, ratio, overlapped=csa, fp8=fp8)
        if fp8:
            compressed = fp8_cache.entries_kv(entries, ctx.dev[f"{ratio}.table"])
        else:
            compressed = PagedKV(entries.view(-1, ragged.ENTRY_PAGE, entries.shape[1]), ctx.dev[f"{ratio}.table"])
        if csa:  # the indexer's output is an integer selection: no gradient, as in eager
            with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
                index_entries = compress(comp.indexer, x, lstate, "indexer", ctx, ratio, overlapped=True)
                topk = indexer_topk(comp.indexer, x, q_residual, index_entries, ctx, integ)

    sink = module.sinks
    if sink.dtype not in (torch.float32, torch.float64):  # a model cast to 16 bits: the kernel takes float32
        sink = sink.float()
    out = prefill_attention(
        q,
        ctx.meta[spec.kind],
        raw,
        compressed,
        sm_scale=module.scaling,
        attn_sink=sink,
        topk_indices=topk,
        backend=integ.backend,
        dropout_p=float(module.attention_dropout) if module.training else 0.0,
    )
    out = rope(out, cos, -sin)  # undo the values' RoPE at the query position, as transformers does
    y = module.o_b_proj(module.o_a_proj(out.reshape(Tr, cfg.o_groups, -1)).flatten(1))
    return ctx.unpack(y)


def write_window(lstate: ragged.LayerState, kv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """The layer's window regions after this call's tokens `kv` (Tr, D) are written
    (`ragged.plan_window`): in place, or into new regions holding each request's last W-1 rows
    when the plan rebuilds them. A replayable forward writes into a copy (the old tensor is a
    layer's input state)."""
    plan, dev = ctx.window, ctx.dev
    buf = lstate.window
    if plan.relayout or buf is None:
        grown = kv.new_zeros((plan.layout.total_rows, kv.shape[1]))
        if buf is not None and plan.move_src.size:
            grown[dev["window_move_dst"]] = buf[dev["window_move_src"]]
        buf = grown.index_copy_(0, dev["window_append"], kv)
    elif writable_in_place(buf, ctx):
        buf.index_copy_(0, dev["window_append"], kv)
    else:
        buf = buf.index_copy(0, dev["window_append"], kv)
    lstate.window = buf
    return buf


def writable_in_place(t: torch.Tensor, ctx: ForwardContext) -> bool:
    """Whether a state tensor may take this call's rows in place: not when the forward is
    replayable (the old tensor is a layer's input state), nor for an inference tensor outside
    inference mode (torch refuses it)."""
    return not ctx.replayable and (not t.is_inference() or torch.is_inference_mode_enabled())


def compress(cmod, x, lstate: ragged.LayerState, name: str, ctx: ForwardContext, r: int, overlapped: bool, fp8=False):
    """Pool every request's newly completed blocks (transformers' compressor math, ragged) and
    append the entries to the request's region; returns the layer's entry rows."""
    plan = ctx.compress[r]
    dev = {
        k: ctx.dev[f"{r}.{k}"]
        for k in ("usable", "leftover", "prev", "overlap", "positions", "move_src", "move_dst", "append_dst")
    }
    cs = lstate.compressors.setdefault(name, ragged.CompressorState(r))
    kv, gate = cmod.kv_proj(x), cmod.gate_proj(x)  # (Tr, C), without the position bias
    stream_kv = kv if cs.buf_kv is None else torch.cat([cs.buf_kv, kv])
    stream_gate = gate if cs.buf_gate is None else torch.cat([cs.buf_gate, gate])
    cs.buf_kv, cs.buf_gate = stream_kv[dev["leftover"]], stream_gate[dev["leftover"]]
    n, C = plan.n_windows, kv.shape[1]
    new_entries = None
    if n:
        chunk_kv = stream_kv[dev["usable"]].view(n, r, C)
        chunk_gate = stream_gate[dev["usable"]].view(n, r, C) + cmod.position_bias
        if overlapped:  # entry w pools the Ca half of block w-1 and the Cb half of block w
            half = cmod.head_dim
            ca_kv, ca_gate = chunk_kv[..., :half], chunk_gate[..., :half]
            if cs.overlap_kv is None:
                cs.overlap_kv = ca_kv.new_zeros((ctx.B, r, half))
                cs.overlap_gate = ca_gate.new_zeros((ctx.B, r, half))
            prev_kv = torch.cat([ca_kv, cs.overlap_kv, ca_kv.new_zeros((1, r, half))])[dev["prev"]]
            prev_gate = torch.cat([ca_gate, cs.overlap_gate, ca_gate.new_full((1, r, half), float("-inf"))])[
                dev["prev"]
            ]
            cs.overlap_kv = torch.cat([ca_kv, cs.overlap_kv])[dev["overlap"]]
            cs.overlap_gate = torch.cat([ca_gate, cs.overlap_gate])[dev["overlap"]]
            chunk_kv = torch.cat([prev_kv, chunk_kv[..., half:]], dim=1)  # (n, 2r, half)
            chunk_gate = torch.cat([prev_gate, chunk_gate[..., half:]], dim=1)
        weights = chunk_gate.softmax(dim=1, dtype=torch.float32).to(chunk_kv.dtype)
        pooled = cmod.kv_norm((chunk_kv * weights).sum(dim=1))  # (n, head_dim)
        cos, sin = cmod.rotary_emb(pooled, position_ids=dev["positions"][None], layer_type=cmod.rope_layer_type)
        new_entries = rope(pooled[None, None], cos, sin)[0, 0]
    if fp8:  # the entries as fp8_ds_mla pages
        return fp8_cache.store_entries(cs, plan, dev, new_entries, x.device, copy=ctx.replayable)
    if plan.relayout or cs.entries is None:
        grown = x.new_zeros((plan.layout.total_rows, cmod.head_dim))
        if cs.entries is not None and plan.move_src.size:
            grown[dev["move_dst"]] = cs.entries[dev["move_src"]]
        cs.entries = grown
    if n:
        if writable_in_place(cs.entries, ctx):
            cs.entries[dev["append_dst"]] = new_entries
        else:  # a new tensor (a replayable forward keeps the one before as a layer's input state)
            cs.entries = cs.entries.index_put((dev["append_dst"],), new_entries)
    return cs.entries


def indexer_topk(ind, x, q_residual, entries, ctx: ForwardContext, integ: Settings):
    """(Tr, index_topk) int32 request-local top-k entry ids per token, -1 = none: transformers' indexer
    queries and weights, scored and selected by `dsv4_torch.indexer.indexer_topk` (each request
    against its own entries; "auto": the fused C kernel on CPU tensors). transformers' scorer
    `sum_h (w_h * H**-0.5) * relu(q_h . k) * D**-0.5` with both scales folded into the weights."""
    from dsv4_torch.indexer import indexer_topk as select

    Tr = x.shape[0]
    positions = ctx.dev["token_positions"]
    cos, sin = ind.rotary_emb(x, position_ids=positions[None], layer_type=ind.rope_layer_type)
    q = ind.q_b_proj(q_residual).view(1, Tr, -1, ind.head_dim).transpose(1, 2)
    q = rope(q, cos, sin).transpose(1, 2)[0]  # (Tr, index_n_heads, index_head_dim)
    scorer = ind.scorer
    w = scorer.weights_proj(x).float() * (scorer.weights_scaling * scorer.softmax_scale)
    if q.dtype not in (torch.bfloat16, torch.float32):  # (a float16 model: the indexer reads bf16 / float32)
        q, entries = q.float(), entries.float()
    layout = ctx.compress[ind.compress_rate].layout
    res = select(
        q,
        w,
        entries,
        ctx.token_request,
        ctx.token_position,
        int(ind.compress_rate),
        int(ind.index_topk),
        offsets=np.asarray(layout.start[: ctx.B], dtype=np.int64),
        backend=integ.indexer_backend,
        reference_elems=integ.indexer_chunk_elems,
    )
    return res.indices  # int32, -1 = none (prefill_attention takes int32 or int64)
