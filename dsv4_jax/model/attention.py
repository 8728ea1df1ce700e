"""One attention layer of the model: step inputs, per-request caches, compressors, the
Lightning Indexer and the sparse prefill call (notes section 7). Caches are described in
`dsv4_jax.model.model`'s docstring."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.tree_util import register_pytree_node_class

from dsv4_jax.indexer import indexer_topk
from dsv4_jax.model import fp8_cache
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.layers import (
    apply_rope,
    linear,
    rms_norm,
    rms_norm_unweighted,
    rope_cos_sin,
)
from dsv4_jax.model.quant import dense
from dsv4_jax.prefill import LogicalKV, prefill_attention
from planner import LayerKind

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST

# ----------------------------------------------------------------------------- step inputs


@register_pytree_node_class
@dataclass
class StepInputs:
    """Device arrays of one step (padded to buckets). Built by `DeepseekV4.prepare_step`.

    Per token (T_pad,): token_ids, positions (absolute), token_request (b), token_valid.
    Per request (B_pad,): slot (cache slot; pad requests get S, out of range: writes dropped),
    prefix (context before the step), seq_len (after), token_start (first token row).
    index_entries: static, the indexer's scored entries per token (>= every visible one).
    """

    token_ids: jax.Array
    positions: jax.Array
    token_request: jax.Array
    token_valid: jax.Array
    slot: jax.Array
    prefix: jax.Array
    seq_len: jax.Array
    token_start: jax.Array
    index_entries: int = 0

    def tree_flatten(self):
        fields = [f.name for f in dataclasses.fields(self) if f.name != "index_entries"]
        return tuple(getattr(self, f) for f in fields), self.index_entries

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, index_entries=aux)


# ----------------------------------------------------------------------------- caches


def init_cache(cfg: ModelConfig, num_slots: int, max_model_len: int, dtype, kv_cache_dtype: str = "auto") -> list[dict]:
    """Zeroed per-layer caches for `num_slots` requests of up to `max_model_len` tokens.

    kv_cache_dtype "fp8_ds_mla": the window and the compressed entries as vLLM's pages
    (`dsv4_jax.model.fp8_cache`); the compressor rings and indexer keys stay in `dtype`."""
    D, W = cfg.head_dim, cfg.sliding_window
    fp8 = kv_cache_dtype == "fp8_ds_mla"
    caches = []
    for spec in cfg.layers:
        kind, r = spec.kind, spec.compress_ratio
        c = {"window": fp8_cache.window_pages(num_slots, W) if fp8 else jnp.zeros((num_slots, max(W - 1, 1), D), dtype)}
        if kind is not LayerKind.SWA:
            overlap = kind is LayerKind.CSA
            width = (2 if overlap else 1) * D
            ring = (2 if overlap else 1) * r
            c["entries"] = (
                fp8_cache.entry_pages(num_slots, max_model_len, r)
                if fp8
                else jnp.zeros((num_slots, -(-max_model_len // r), D), dtype)
            )
            c["ring_kv"] = jnp.zeros((num_slots, ring, width), dtype)
            c["ring_gate"] = jnp.zeros((num_slots, ring, width), dtype)
        if kind is LayerKind.CSA:
            dh = cfg.index_head_dim
            c["index_entries"] = jnp.zeros((num_slots, -(-max_model_len // r), dh), dtype)
            c["index_ring_kv"] = jnp.zeros((num_slots, 2 * r, 2 * dh), dtype)
            c["index_ring_gate"] = jnp.zeros((num_slots, 2 * r, 2 * dh), dtype)
        caches.append(c)
    return caches


def _window_step(window, kv, step: StepInputs):
    """Raw rows for this step's attention, and the updated window ring.

    Returns a `LogicalKV` holding, per request b, the W-1 positions before its prefix (from the
    ring; negative positions are junk that no index reaches) then its new tokens, contiguous,
    with `offsets[b] + position` = row; and the ring with the last W-1 positions written.
    """
    S, Wc, D = window.shape
    T, B = kv.shape[0], step.slot.shape[0]
    slot = jnp.minimum(step.slot, S - 1)
    base = jnp.arange(B, dtype=jnp.int32) * Wc + step.token_start  # first packed row of request b
    hist_pos = step.prefix[:, None] - Wc + jnp.arange(Wc, dtype=jnp.int32)  # (B, Wc)
    hist = window[slot[:, None], hist_pos % Wc]  # (B, Wc, D)
    packed = jnp.zeros((B * Wc + T, D), kv.dtype)
    packed = packed.at[(base[:, None] + jnp.arange(Wc, dtype=jnp.int32)).reshape(-1)].set(
        hist.reshape(-1, D), mode="drop"
    )
    b = step.token_request
    new_rows = jnp.arange(T, dtype=jnp.int32) + (b + 1) * Wc  # = base[b] + Wc + (t - token_start[b])
    packed = packed.at[jnp.where(step.token_valid, new_rows, packed.shape[0])].set(kv, mode="drop")
    raw = LogicalKV(packed, (base + Wc - step.prefix).astype(jnp.int32))
    keep = step.token_valid & (step.positions >= step.seq_len[b] - Wc)
    window = window.at[jnp.where(keep, step.slot[b], S), step.positions % Wc].set(kv, mode="drop")
    return raw, window


def _compress(
    p, x, entries, ring_kv, ring_gate, step: StepInputs, cfg: ModelConfig, ratio: int, overlap: bool, write=None
):
    """One compressor (section 8): emit this step's completed entries, update the ring.

    p: wkv, wgate (C, hidden), ape (ratio, C), norm (d,), with C = 2d (overlap) or d.
    entries (S, cap, d): entry w of slot s at [s, w]. ring_kv, ring_gate (S, ring, C): the
    projected kv / gate (no position bias) of position q at row q % ring.
    """
    S, ring = ring_kv.shape[:2]
    d = p["norm"].shape[-1]
    T, B = x.shape[0], step.slot.shape[0]
    kv = linear(x, p["wkv"])  # (T, C)
    gate = linear(x, p["wgate"])
    slot = jnp.minimum(step.slot, S - 1)

    def rows_at(b, q):
        """Projected (kv, gate) of position q of request b: from the ring before the prefix."""
        old = (q < step.prefix[b])[..., None]
        t = jnp.clip(step.token_start[b] + q - step.prefix[b], 0, T - 1)
        ring_row = q % ring
        return (
            jnp.where(old, ring_kv[slot[b], ring_row], kv[t]),
            jnp.where(old, ring_gate[slot[b], ring_row], gate[t]),
        )

    first = step.prefix // ratio
    count = step.seq_len // ratio - first  # entries each request completes now (pad requests: 0)
    ends = jnp.cumsum(count)
    total = ends[-1]
    E = T // ratio + B  # bound: sum_b floor((prefix_b % r + q_b) / r) <= T/r + B

    def emit(entries):
        e = jnp.arange(E, dtype=jnp.int32)
        owner = jnp.minimum(jnp.searchsorted(ends, e, side="right").astype(jnp.int32), B - 1)
        w = first[owner] + e - (ends[owner] - count[owner])
        pos = w[:, None] * ratio + jnp.arange(ratio, dtype=jnp.int32)  # (E, r)
        kv_c, gate_c = rows_at(owner[:, None], pos)
        ape = p["ape"].astype(F32)
        if overlap:  # slots 0..r-1: Ca of block w-1; slots r..2r-1: Cb of block w
            kv_p, gate_p = rows_at(owner[:, None], pos - ratio)
            has_prev = (w > 0)[:, None, None]
            slot_kv = jnp.concatenate([jnp.where(has_prev, kv_p[..., :d], 0), kv_c[..., d:]], axis=1)
            slot_gate = jnp.concatenate(
                [jnp.where(has_prev, gate_p[..., :d] + ape[:, :d], -jnp.inf), gate_c[..., d:] + ape[:, d:]], axis=1
            )
        else:
            slot_kv, slot_gate = kv_c, gate_c + ape
        weights = jax.nn.softmax(slot_gate.astype(F32), axis=1).astype(slot_kv.dtype)
        pooled = (slot_kv * weights).sum(axis=1)
        cos, sin = rope_cos_sin(w * ratio, cfg.rope_compress, cfg.rope_head_dim)
        entry = apply_rope(rms_norm(pooled, p["norm"], cfg.rms_norm_eps), cos, sin)
        if write is not None:  # fp8_ds_mla pages (fp8_cache.entry_writer)
            return write(entries, jnp.where(e < total, step.slot[owner], -1), w, entry)
        dst = jnp.where(e < total, step.slot[owner], S)
        return entries.at[dst, w].set(entry.astype(entries.dtype), mode="drop")

    entries = lax.cond(total > 0, emit, lambda e: e, entries)
    b = step.token_request
    keep = step.token_valid & (step.positions >= step.seq_len[b] - ring)
    dst = jnp.where(keep, step.slot[b], S)
    ring_kv = ring_kv.at[dst, step.positions % ring].set(kv.astype(ring_kv.dtype), mode="drop")
    ring_gate = ring_gate.at[dst, step.positions % ring].set(gate.astype(ring_gate.dtype), mode="drop")
    return entries, ring_kv, ring_gate


def _index_topk(p, x, q_residual, entries, step: StepInputs, cfg: ModelConfig, backend: str = "auto"):
    """Lightning Indexer scores and top-k (section 9): (T, index_topk) int32 entry ids, -1 = none.

    `dsv4_jax.indexer.indexer_topk` (backend "auto": the fused C kernel on the CPU) over each
    request's entry rows (slot * cap + entry): row t holds its top min(visible, topk) visible
    entries (visible = (p+1)//r, r the CSA ratio), larger logits first, ties by lower entry.
    logit = sum_h w_h relu(q_h . k) with w = weights_proj(x) * nh**-0.5 * dh**-0.5 (the scales
    folded into the weights, as vLLM folds them).
    """
    T = x.shape[0]
    S, cap, dh = entries.shape
    nh = cfg.index_n_heads
    cos, sin = rope_cos_sin(step.positions, cfg.rope_compress, cfg.rope_head_dim)
    q = apply_rope(linear(q_residual, p["wq_b"]).reshape(T, nh, dh), cos[:, None], sin[:, None]).astype(F32)
    head_w = linear(x, p["weights_proj"]).astype(F32) * (nh**-0.5 * dh**-0.5)  # (T, nh)
    keys = entries.reshape(S * cap, dh)
    if keys.dtype not in (jnp.bfloat16, F32):  # (a float16 model: the indexer reads bf16 / float32 keys)
        keys = keys.astype(F32)
    res = indexer_topk(
        q,
        head_w,
        keys,
        step.token_request,
        step.positions,
        compress_ratio=cfg.compress_rate_csa,
        topk=cfg.index_topk,
        offsets=jnp.minimum(step.slot, S - 1) * cap,
        valid=step.token_valid,
        num_entries=min(step.index_entries, cap),
        backend=backend,
    )
    return res.indices


# ----------------------------------------------------------------------------- attention (section 7)


def _attend(q, meta, raw, comp, sink, topk, *, sm_scale, backend, interpret, mesh, axis):
    """`prefill_attention` for one layer; with a mesh, query heads are split over `axis`.

    The split is `dsv4_jax.sharding.sparse_attention_head_sharded`'s (q, sink and the output by
    head; workspace sources, metadata and top-k replicated), one level up: each device runs the
    whole chunk loop (gathers, indices) for its heads. No communication inside; the check of
    replicated values is off because it cannot see through pallas_call.
    """
    kw = dict(sm_scale=sm_scale, backend=backend, interpret=interpret)
    if mesh is None:
        return prefill_attention(q, meta, raw, comp, attn_sink=sink, topk_indices=topk, **kw)

    def per_device(q, sink, meta, raw, comp, topk):
        return prefill_attention(q, meta, raw, comp, attn_sink=sink, topk_indices=topk, **kw)

    heads = P(None, axis, None)
    f = jax.shard_map(
        per_device, mesh=mesh, in_specs=(heads, P(axis), P(), P(), P(), P()), out_specs=heads, check_vma=False
    )
    return f(q, sink, meta, raw, comp, topk)


def attention(p, cache: dict, x, step: StepInputs, meta, cfg: ModelConfig, kind: LayerKind, opts):
    """One attention block on the step's tokens: x (T, hidden) -> (T, hidden), updated cache."""
    T = x.shape[0]
    H, D, R = cfg.num_attention_heads, cfg.head_dim, cfg.rope_head_dim
    eps = cfg.rms_norm_eps
    rope = cfg.rope_main if kind is LayerKind.SWA else cfg.rope_compress
    cos, sin = rope_cos_sin(step.positions, rope, R)
    q_residual = rms_norm(linear(x, p["wq_a"]), p["q_norm"], eps)
    q = rms_norm_unweighted(linear(q_residual, p["wq_b"]).reshape(T, H, D), eps)
    q = apply_rope(q, cos[:, None], sin[:, None])
    kv = apply_rope(rms_norm(linear(x, p["wkv"]), p["kv_norm"], eps), cos, sin)  # K = V, one head

    cache = dict(cache)
    opts = dict(opts)
    fp8 = opts.pop("kv_cache_dtype", "auto") == "fp8_ds_mla"
    indexer_backend = opts.pop("indexer_backend", "auto")
    max_model_len = opts.pop("max_model_len", None)
    if fp8:
        raw, cache["window"] = fp8_cache.window_step(cache["window"], kv, step, cfg.sliding_window, max_model_len)
    else:
        raw, cache["window"] = _window_step(cache["window"], kv, step)
    comp = topk = None
    if kind is not LayerKind.SWA:
        r = cfg.compress_ratio(kind)
        overlap = kind is LayerKind.CSA
        cap = fp8_cache.entry_capacity(max_model_len, r) if fp8 else cache["entries"].shape[1]
        cache["entries"], cache["ring_kv"], cache["ring_gate"] = _compress(
            p["compressor"],
            x,
            cache["entries"],
            cache["ring_kv"],
            cache["ring_gate"],
            step,
            cfg,
            r,
            overlap,
            write=fp8_cache.entry_writer(cap) if fp8 else None,
        )
        if fp8:
            comp = fp8_cache.entries_kv(cache["entries"], step, cap)
        else:
            comp = LogicalKV(cache["entries"].reshape(-1, D), (step.slot * cap).astype(jnp.int32))
    if kind is LayerKind.CSA:
        ip = p["indexer"]
        cache["index_entries"], cache["index_ring_kv"], cache["index_ring_gate"] = _compress(
            ip, x, cache["index_entries"], cache["index_ring_kv"], cache["index_ring_gate"], step, cfg, r, True
        )
        topk = _index_topk(ip, x, q_residual, cache["index_entries"], step, cfg, indexer_backend)

    out = _attend(q, meta, raw, comp, p["sink"].astype(F32), topk, sm_scale=D**-0.5, **opts)
    out = apply_rope(out, cos[:, None], -sin[:, None])  # undo V's RoPE at the query position
    G = cfg.o_groups
    grouped = out.reshape(T, G, H * D // G)
    wo_a = dense(p["wo_a"], out.dtype).reshape(G, -1, H * D // G)  # (G * o_lora, H*D/G) -> per group
    y = jnp.einsum("tgi,goi->tgo", grouped, wo_a, precision=HIGHEST, preferred_element_type=F32)
    return linear(y.astype(x.dtype).reshape(T, -1), p["wo_b"]), cache
