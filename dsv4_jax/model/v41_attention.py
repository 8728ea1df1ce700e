"""One DeepSeek-V4.1 attention layer: the compressors at ratio 2 and 1, the shared compressed
caches, the indexer (Reuse / Reindex, two-level top-k), transformers' fake quantization and
the sparse prefill call (`dsv4_jax.prefill.prefill_attention`, the same kernels as V4).

The math is transformers' `DeepseekV41Attention` (docs/jax-model.md, "DeepSeek-V4.1"):

* q = wq_b(q_norm(wq_a(x))) per head, RoPE (no per-head norm, unlike V4); K = V =
  kv_norm(wkv(x)), RoPE, FP8 fake-quantized, into this layer's window ring.
* A KV source's compressor emits its step's finished entries: ratio 2 pools positions 2j, 2j+1
  (projections and the per-channel softmax gate in float32, then RMSNorm), ratio 1 is
  norm(wkv(x_j)) with no gate. The pre-RoPE latent feeds the index keys (k_norm(wk(latent)),
  RoPE at the entry's first position, FP4 per 32); the entry itself gets RoPE there and FP4
  (e4m3 scale per 16) and goes into the source's compressed cache, which every later
  compressed layer up to the next source reads.
* An index source scores each row against its KV source's index keys: logit = sum_h w_h
  relu(q_h . k) dh^-1/2 with w = weights_proj(x) nh^-1/2 and q = FP4(RoPE(wq_b(q_residual)));
  entry j is visible to position p iff j < (p + 1) // ratio; the candidate source also keeps
  the candidate blocks, later index sources choose inside them (`two_level_select`). Other
  compressed layers reuse the last index source's top-k.

Fake quantization (`fake_quant=True`, transformers' forward): window KV FP8 e4m3 with a UE8M0
scale per 32 dims, compressed KV FP4 e2m1 with an e4m3 scale per 16, indexer q and k FP4 with a
UE8M0 scale per 32; a last dim that does not divide its block is left as is (as transformers
does). Off, the caches hold the unquantized values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv4_jax.model.attention import StepInputs, _attend, _window_step
from dsv4_jax.model.layers import apply_rope, linear, rms_norm, rope_cos_sin
from dsv4_jax.model.quant import dense
from dsv4_jax.model.v41_config import V41Config
from dsv4_jax.prefill import LogicalKV

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
FP8_MAX = 448.0
FP4_MAX = 6.0
_E2M1_TABLE = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
# e2m1 rounding (to nearest, ties to the even code): a magnitude reaches code c + 1 at these
# thresholds; ties at 0.25, 1.25, 2.5, 5.0 round down (strictly above), at 0.75, 1.75, 3.5 up.
_E2M1_UP = np.array(
    [np.nextafter(np.float32(0.25), np.float32(1)), 0.75, np.nextafter(np.float32(1.25), np.float32(2)), 1.75]
    + [np.nextafter(np.float32(2.5), np.float32(3)), 3.5, np.nextafter(np.float32(5.0), np.float32(6))],
    np.float32,
)

# ----------------------------------------------------------------------------- fake quantization


def _pow2_ceil(t):
    """2^ceil(log2 t) for float32 t > 0 (normal), exactly: the UE8M0 scale rounding."""
    bits = lax.bitcast_convert_type(t.astype(F32), jnp.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return lax.bitcast_convert_type((k + 127) << 23, F32)


def fake_quant_fp8(x, block: int = 32):
    """x quantized to e4m3 with a UE8M0 scale per `block` of the last dim, and back (x's dtype)."""
    n = x.shape[-1]
    if n % block:
        return x
    b = x.astype(F32).reshape(*x.shape[:-1], n // block, block)
    amax = jnp.maximum(jnp.abs(b).max(axis=-1), F32(1e-4))
    scale = _pow2_ceil(amax * F32(1.0 / FP8_MAX))[..., None]
    q = jnp.clip(b / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(F32)
    return (q * scale).reshape(x.shape).astype(x.dtype)


def fake_quant_fp4(x, block: int, e4m3_scales: bool = False):
    """x quantized to e2m1 per `block` of the last dim (scale: e4m3 of amax / 6 if `e4m3_scales`,
    else UE8M0 2^ceil(log2(amax / 6))), and back, in x's dtype."""
    n = x.shape[-1]
    if n % block:
        return x
    b = x.astype(F32).reshape(*x.shape[:-1], n // block, block)
    amax = jnp.abs(b).max(axis=-1)
    if e4m3_scales:
        scale = (jnp.maximum(amax, F32(FP4_MAX * 2.0**-9)) / F32(FP4_MAX)).astype(jnp.float8_e4m3fn).astype(F32)
    else:
        scale = _pow2_ceil(jnp.maximum(amax, F32(FP4_MAX * 2.0**-126)) * F32(1.0 / FP4_MAX))
    scale = scale[..., None]
    q = jnp.clip(b / scale, -FP4_MAX, FP4_MAX)
    code = (jnp.abs(q)[..., None] >= jnp.asarray(_E2M1_UP)).sum(axis=-1)
    code = code + 8 * jnp.signbit(q).astype(code.dtype)
    return (jnp.asarray(_E2M1_TABLE)[code] * scale).reshape(x.shape).astype(x.dtype)


# ----------------------------------------------------------------------------- caches


def init_cache_v41(cfg: V41Config, num_slots: int, max_model_len: int, dtype) -> list[dict]:
    """Zeroed per-layer caches for `num_slots` requests of up to `max_model_len` tokens.

    Every layer: window (S, W-1, D), the ring of its last W-1 window latents (position q at row
    q % (W-1)). A KV source also holds entries (S, cdiv(L, r), D), its compressed cache (entry
    j of slot s at [s, j], RoPE applied), index_keys (S, cdiv(L, r), index_head_dim), and at
    ratio 2 ring_kv / ring_gate (S, 2, D) float32: the projections of the last 2 positions (an
    unfinished pair waits here). Rows a request has not written are never read."""
    D, W = cfg.head_dim, cfg.sliding_window
    caches = []
    for role in cfg.schedule:
        c = {"window": jnp.zeros((num_slots, max(W - 1, 1), D), dtype)}
        if role.is_kv_source:
            r = role.compress_ratio
            cap = -(-max_model_len // r)
            c["entries"] = jnp.zeros((num_slots, cap, D), dtype)
            c["index_keys"] = jnp.zeros((num_slots, cap, cfg.index_head_dim), dtype)
            if r > 1:
                c["ring_kv"] = jnp.zeros((num_slots, r, D), F32)
                c["ring_gate"] = jnp.zeros((num_slots, r, D), F32)
        caches.append(c)
    return caches


# ----------------------------------------------------------------------------- compressors


def _pool(p, x, ring_kv, ring_gate, rows: StepInputs, ratio: int, eps: float):
    """Ratio >= 2: the entries the step's rows complete, pooled with the float32 softmax gate.

    Returns (latent (E, D) pre-RoPE in x's dtype, entry ids (E,), their slots (E,) with S for
    none, ring_kv, ring_gate). E = T // ratio + B bounds the entries of any step."""
    S, ring = ring_kv.shape[:2]
    T, B = x.shape[0], rows.slot.shape[0]
    xf = x.astype(F32)
    kv = linear(xf, p["wkv"])  # float32 projections, as transformers computes them
    gate = linear(xf, p["wgate"])
    slot = jnp.minimum(rows.slot, S - 1)

    def rows_at(b, q):
        old = (q < rows.prefix[b])[..., None]
        t = jnp.clip(rows.token_start[b] + q - rows.prefix[b], 0, T - 1)
        ring_row = q % ring
        return (
            jnp.where(old, ring_kv[slot[b], ring_row], kv[t]),
            jnp.where(old, ring_gate[slot[b], ring_row], gate[t]),
        )

    first = rows.prefix // ratio
    count = rows.seq_len // ratio - first  # entries each request completes now (pad requests: 0)
    ends = jnp.cumsum(count)
    E = T // ratio + B
    e = jnp.arange(E, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(ends, e, side="right").astype(jnp.int32), B - 1)
    w = first[owner] + e - (ends[owner] - count[owner])
    pos = w[:, None] * ratio + jnp.arange(ratio, dtype=jnp.int32)  # (E, r)
    kv_c, gate_c = rows_at(owner[:, None], pos)
    pooled = (kv_c * jax.nn.softmax(gate_c, axis=1)).sum(axis=1)
    latent = rms_norm(pooled.astype(x.dtype), p["norm"], eps)
    dst = jnp.where(e < ends[-1], rows.slot[owner], S)
    b = rows.token_request
    keep = rows.token_valid & (rows.positions >= rows.seq_len[b] - ring)
    at = jnp.where(keep, rows.slot[b], S)
    ring_kv = ring_kv.at[at, rows.positions % ring].set(kv, mode="drop")
    ring_gate = ring_gate.at[at, rows.positions % ring].set(gate, mode="drop")
    return latent, jnp.maximum(w, 0), dst, ring_kv, ring_gate


def _compress_and_publish(p, ip, cache: dict, x, rows: StepInputs, cfg: V41Config, ratio: int, fake_quant: bool):
    """A KV source: its compressor's new entries into `entries`, their index keys into
    `index_keys` (both RoPE'd at the entry's first position, fake-quantized if asked)."""
    S = cache["entries"].shape[0]
    eps = cfg.rms_norm_eps
    cache = dict(cache)
    if ratio == 1:  # every token is its own entry: norm(wkv(x)), no gate
        latent = rms_norm(linear(x, p["wkv"]), p["norm"], eps)
        w = rows.positions
        dst = jnp.where(rows.token_valid, rows.slot[rows.token_request], S)
    else:
        latent, w, dst, cache["ring_kv"], cache["ring_gate"] = _pool(
            p, x, cache["ring_kv"], cache["ring_gate"], rows, ratio, eps
        )
    cos, sin = rope_cos_sin(w * ratio, cfg.rope_compress, cfg.rope_head_dim)
    entry = apply_rope(latent, cos, sin)
    key = apply_rope(rms_norm(linear(latent, ip["wk"]), ip["k_norm"], eps), cos, sin)
    if fake_quant:
        entry = fake_quant_fp4(entry, 16, e4m3_scales=True)
        key = fake_quant_fp4(key, 32)
    cache["entries"] = cache["entries"].at[dst, w].set(entry.astype(cache["entries"].dtype), mode="drop")
    cache["index_keys"] = cache["index_keys"].at[dst, w].set(key.astype(cache["index_keys"].dtype), mode="drop")
    return cache


# ----------------------------------------------------------------------------- indexer


def select_candidate_blocks(logits, visible, topk_blocks: int, block_size: int):
    """Level 1 of the two-level top-k: (R, N) logits (invisible entries -inf), (R,) visible
    counts -> (R, cdiv(N, block_size)) bool, the kept blocks of each row: the block holding the
    newest visible entry pinned, then the highest block maxima, min(topk_blocks, blocks) of
    them, a -inf pick dropped."""
    R, N = logits.shape
    NB = -(-N // block_size)
    padded = jnp.pad(logits, ((0, 0), (0, NB * block_size - N)), constant_values=-jnp.inf)
    blocks = padded.reshape(R, NB, block_size).max(axis=-1)
    newest = (visible - 1) // block_size  # -1 (no block) when nothing is visible
    blocks = jnp.where(jnp.arange(NB)[None, :] == newest[:, None], jnp.inf, blocks)
    vals, ids = lax.top_k(blocks, min(topk_blocks, NB))
    keep = jnp.zeros((R, NB), bool)
    return keep.at[jnp.arange(R)[:, None], ids].set(vals > -jnp.inf)


def two_level_select(logits, visible, *, topk: int, candidates=None, make_candidates=None):
    """The selection of one index source on (R, N) logits (invisible entries -inf).

    candidates: (R, NB) bool from the candidate source (a candidate consumer: logits outside its
      blocks are dropped before the top-k), or None.
    make_candidates: None, or (topk_blocks, block_size) at the candidate source: also return its
      blocks (level 1; its own top-k is not restricted).
    Returns ((R, topk) int32 entry ids, larger logits first, -1 past the visible ones; the
    candidates or None). The one place the selection is made: a two-level API of
    `dsv4_jax.indexer` can replace it.
    """
    R, N = logits.shape
    made = None
    if make_candidates is not None:
        made = select_candidate_blocks(logits, visible, *make_candidates)
    if candidates is not None:
        bs = -(-N // candidates.shape[1])
        inside = jnp.repeat(candidates, bs, axis=1)[:, :N]
        logits = jnp.where(inside, logits, -jnp.inf)
    k = min(topk, N)
    vals, ids = lax.top_k(logits, k)
    ids = jnp.where(vals > -jnp.inf, ids, -1).astype(jnp.int32)
    if k < topk:
        ids = jnp.pad(ids, ((0, 0), (0, topk - k)), constant_values=-1)
    return ids, made


def index_select(q, head_w, keys, rows: StepInputs, *, ratio, n_entries, topk, candidates=None, make_candidates=None):
    """Indexer logits and selection for the rows of `rows`, one request at a time.

    q (R, nh, dh) float32 (RoPE'd, fake-quantized), head_w (R, nh) float32 = weights_proj(x) *
    nh^-1/2, keys (S, cap, dh): the KV source's index keys. n_entries (static) >= every visible
    count of the step. Row tiles of one request share its keys: each tile scores (tile, nh,
    n_entries) in float32, the tile sized to keep that near 128 MB.
    Returns ((R, topk) int32, (R, NB) bool candidates or None).
    """
    R, nh, dh = q.shape
    S, cap = keys.shape[:2]
    rows = jax.tree.map(jnp.asarray, rows)
    N = int(min(n_entries, cap))
    tile = int(max(1, min(256, (1 << 25) // max(nh * N, 1))))
    tile = 1 << (tile.bit_length() - 1)
    pad = lambda a, fill=0: jnp.pad(a, [(0, tile)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)  # noqa: E731
    qp, wp, posp = pad(q), pad(head_w), pad(rows.positions)
    NB = None if make_candidates is None else -(-N // make_candidates[1])
    out_ids = jnp.full((R + tile, topk), -1, jnp.int32)
    out_cand = None if NB is None else jnp.zeros((R + tile, NB), bool)
    cand_in = None if candidates is None else pad(candidates, False)
    scale = dh**-0.5
    B = rows.slot.shape[0]
    slots = jnp.minimum(rows.slot, S - 1)

    def per_request(b, carry):
        start, count = rows.token_start[b], rows.seq_len[b] - rows.prefix[b]
        kb = keys[slots[b], :N].astype(F32)

        def per_tile(k, carry):
            out_ids, out_cand = carry
            r0 = start + k * tile
            qt = lax.dynamic_slice_in_dim(qp, r0, tile)
            wt = lax.dynamic_slice_in_dim(wp, r0, tile)
            pt = lax.dynamic_slice_in_dim(posp, r0, tile)
            s = jnp.einsum("thd,nd->thn", qt, kb, precision=HIGHEST)
            s = jnp.maximum(s, 0) * scale
            logits = (s * wt[:, :, None]).sum(axis=1)
            visible = (pt + 1) // ratio
            logits = jnp.where(jnp.arange(N)[None, :] < visible[:, None], logits, -jnp.inf)
            ct = None if cand_in is None else lax.dynamic_slice_in_dim(cand_in, r0, tile)
            ids, made = two_level_select(logits, visible, topk=topk, candidates=ct, make_candidates=make_candidates)
            mine = (jnp.arange(tile) + k * tile < count)[:, None]
            old = lax.dynamic_slice_in_dim(out_ids, r0, tile)
            out_ids = lax.dynamic_update_slice_in_dim(out_ids, jnp.where(mine, ids, old), r0, 0)
            if out_cand is not None:
                oldc = lax.dynamic_slice_in_dim(out_cand, r0, tile)
                out_cand = lax.dynamic_update_slice_in_dim(out_cand, jnp.where(mine, made, oldc), r0, 0)
            return out_ids, out_cand

        return lax.fori_loop(0, (count + tile - 1) // tile, per_tile, carry)

    out_ids, out_cand = lax.fori_loop(0, B, per_request, (out_ids, out_cand))
    return out_ids[:R], None if out_cand is None else out_cand[:R]


# ----------------------------------------------------------------------------- the layer


def attention_v41(
    p,
    cache: dict,
    source: dict | None,
    shared: dict,
    x_all,
    kv_rows: StepInputs,
    keep,
    rows: StepInputs,
    meta,
    cfg: V41Config,
    role,
    n_entries: int,
    opts,
):
    """One V4.1 attention block.

    x_all (T, hidden): the normed block input of the rows whose KV this layer writes
    (`kv_rows`); `keep` (R,) int32 or None: the rows (of x_all) it computes attention for,
    `rows` their StepInputs (None keep: all of them, rows = kv_rows). `source`: the KV source's
    cache (this layer's own for a source: None). `shared`: {"topk": (R, topk), "candidates":
    (R, NB)} from the index / candidate source, on this layer's rows. Returns (y (R, hidden),
    cache, source cache, shared).
    """
    opts = dict(opts)
    fake_quant = opts.pop("fake_quant")
    opts.pop("indexer_backend", None)
    H, D, R_dim = cfg.num_attention_heads, cfg.head_dim, cfg.rope_head_dim
    eps = cfg.rms_norm_eps
    ratio = role.compress_ratio
    rope = cfg.rope_compress if ratio else cfg.rope_main
    cache = dict(cache)
    shared = dict(shared)

    cos_all, sin_all = rope_cos_sin(kv_rows.positions, rope, R_dim)
    kv = apply_rope(rms_norm(linear(x_all, p["wkv"]), p["kv_norm"], eps), cos_all, sin_all)
    if fake_quant:
        kv = fake_quant_fp8(kv, 32)
    raw, cache["window"] = _window_step(cache["window"], kv, kv_rows)
    if role.is_kv_source:
        cache = _compress_and_publish(p["compressor"], p["indexer"], cache, x_all, kv_rows, cfg, ratio, fake_quant)
        source = cache
    x = x_all if keep is None else x_all[keep]
    q_residual = rms_norm(linear(x, p["wq_a"]), p["q_norm"], eps)
    Rr = x.shape[0]
    cos, sin = rope_cos_sin(rows.positions, rope, R_dim)
    q = apply_rope(linear(q_residual, p["wq_b"]).reshape(Rr, H, D), cos[:, None], sin[:, None])

    comp = topk = None
    if ratio:
        if role.is_index_source:
            ip = p["indexer"]
            nh, dh = cfg.index_n_heads, cfg.index_head_dim
            cq, sq = rope_cos_sin(rows.positions, cfg.rope_compress, R_dim)
            iq = apply_rope(linear(q_residual, ip["wq_b"]).reshape(Rr, nh, dh), cq[:, None], sq[:, None])
            if fake_quant:
                iq = fake_quant_fp4(iq, 32)
            head_w = linear(x, ip["weights_proj"]).astype(F32) * F32(nh**-0.5)
            make = (cfg.candidate_topk_blocks, cfg.candidate_block_size) if role.is_candidate_source else None
            ids, made = index_select(
                iq.astype(F32),
                head_w,
                source["index_keys"],
                rows,
                ratio=ratio,
                n_entries=n_entries,
                topk=cfg.index_topk,
                candidates=shared.get("candidates") if role.uses_candidates else None,
                make_candidates=make,
            )
            shared["topk"] = ids
            if made is not None:
                shared["candidates"] = made
        topk = shared["topk"]
        cap = source["entries"].shape[1]
        comp = LogicalKV(source["entries"].reshape(-1, D), (rows.slot * cap).astype(jnp.int32))

    out = _attend(q, meta, raw, comp, p["sink"].astype(F32), topk, sm_scale=D**-0.5, **opts)
    out = apply_rope(out, cos[:, None], -sin[:, None])  # undo V's RoPE at the query position
    G = cfg.o_groups
    grouped = out.reshape(Rr, G, H * D // G)
    wo_a = dense(p["wo_a"], out.dtype).reshape(G, -1, H * D // G)
    y = jnp.einsum("tgi,goi->tgo", grouped, wo_a, precision=HIGHEST, preferred_element_type=F32)
    y = linear(y.astype(x.dtype).reshape(Rr, -1), p["wo_b"])
    return y, cache, source, shared
