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
  the candidate blocks (level 1), later index sources choose inside them (level 2): both through
  the library's `dsv4_jax.indexer.indexer_topk` (`index_select`; "auto" on the CPU = the fused
  C kernel). Other compressed layers reuse the last index source's top-k.

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

from dsv4_jax.indexer import indexer_topk
from dsv4_jax.model import mxfp8_cache
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


def init_cache_v41(
    cfg: V41Config, num_slots: int, max_model_len: int, dtype, kv_cache_dtype: str = "auto"
) -> list[dict]:
    """Zeroed per-layer caches for `num_slots` requests of up to `max_model_len` tokens.

    Every layer: window (S, W-1, D), the ring of its last W-1 window latents (position q at row
    q % (W-1)). A KV source also holds entries (S, cdiv(L, r), D), its compressed cache (entry
    j of slot s at [s, j], RoPE applied), index_keys (S, cdiv(L, r), index_head_dim), and at
    ratio 2 ring_kv / ring_gate (S, 2, D) float32: the projections of the last 2 positions (an
    unfinished pair waits here). Rows a request has not written are never read.
    kv_cache_dtype "fp8_ds_mla": window and entries as V4.1's 528-byte mxfp8 pages
    (`dsv4_jax.model.mxfp8_cache`, same slots); the rings and index keys stay in `dtype`."""
    D, W = cfg.head_dim, cfg.sliding_window
    fp8 = kv_cache_dtype == "fp8_ds_mla"
    caches = []
    for role in cfg.schedule:
        if fp8:
            c = {"window": mxfp8_cache.window_pages(num_slots, W)}
        else:
            c = {"window": jnp.zeros((num_slots, max(W - 1, 1), D), dtype)}
        if role.is_kv_source:
            r = role.compress_ratio
            cap = -(-max_model_len // r)
            if fp8:
                c["entries"] = mxfp8_cache.entry_pages(num_slots, max_model_len, r)
            else:
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


def _compress_and_publish(
    p, ip, cache: dict, x, rows: StepInputs, cfg: V41Config, ratio: int, fake_quant: bool, cap: int | None = None
):
    """A KV source: its compressor's new entries into `entries`, their index keys into
    `index_keys` (both RoPE'd at the entry's first position, fake-quantized if asked). cap: the
    entries per slot of mxfp8 entry pages (None: float entries (S, cap, D))."""
    S = cache["index_keys"].shape[0]
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
    if cap is None:
        cache["entries"] = cache["entries"].at[dst, w].set(entry.astype(cache["entries"].dtype), mode="drop")
    else:
        cache["entries"] = mxfp8_cache.write_entries(cache["entries"], dst, w, entry, cap)
    cache["index_keys"] = cache["index_keys"].at[dst, w].set(key.astype(cache["index_keys"].dtype), mode="drop")
    return cache


# ----------------------------------------------------------------------------- indexer


def index_select(
    q,
    head_w,
    keys,
    rows: StepInputs,
    *,
    ratio,
    n_entries,
    topk,
    block_size=None,
    candidates=None,
    make_candidates=None,
    backend="auto",
):
    """Indexer selection of one index source: `dsv4_jax.indexer.indexer_topk` on the rows of `rows`.

    q (R, nh, dh) float32 (RoPE'd, fake-quantized), head_w (R, nh) float32 = weights_proj(x) *
    nh^-1/2, keys (S, cap, dh): the KV source's index keys (entry e of slot s at [s, e]). The
    logit is sum_h w_h relu(q_h . k) dh^-1/2 with dh^-1/2 folded into the head weights (as V4's
    indexer and vLLM fold it). n_entries (static) >= every visible count of the step (backend
    "xla" scores that many; "cpu" streams each row's visible ones).
    candidates: None, or (R, candidate_topk_blocks) int32 request-local block ids of
      `block_size` entries from the candidate source (level 2: the top-k inside them; -1 = none).
    make_candidates: None, or topk_blocks at the candidate source (level 1: its best blocks of
      `block_size` entries too; its own top-k is the ordinary one).
    backend: a name of `dsv4_jax.backends.INDEXER` (resolved by the model) or "auto".
    Returns ((R, topk) int32 entry ids, larger logits first, equal ones lower entry first, -1
    past the visible ones; (R, topk_blocks) int32 candidates or None).
    """
    S, cap, dh = keys.shape
    flat = keys.reshape(S * cap, dh)
    if flat.dtype not in (jnp.bfloat16, F32):  # (the indexer reads bf16 / float32 rows)
        flat = flat.astype(F32)
    kw = {}
    if make_candidates is not None:
        kw = dict(candidate_topk_blocks=make_candidates, candidate_block_size=block_size)
    elif candidates is not None:
        kw = dict(candidates=candidates, candidate_block_size=block_size)
    res = indexer_topk(
        q.astype(F32),
        head_w.astype(F32) * F32(dh**-0.5),
        flat,
        rows.token_request,
        rows.positions,
        ratio,
        topk,
        offsets=(jnp.minimum(jnp.asarray(rows.slot), S - 1) * cap).astype(jnp.int32),
        valid=rows.token_valid,
        num_entries=int(min(n_entries, cap)),
        backend=backend,
        **kw,
    )
    return res.indices, res.candidates


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
    indexer_backend = opts.pop("indexer_backend", "auto")
    fp8 = opts.pop("kv_cache_dtype", "auto") == "fp8_ds_mla"
    max_model_len = opts.pop("max_model_len", None)
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
    if fp8:
        raw, cache["window"] = mxfp8_cache.window_step(cache["window"], kv, kv_rows, cfg.sliding_window, max_model_len)
    else:
        raw, cache["window"] = _window_step(cache["window"], kv, kv_rows)
    cap = mxfp8_cache.entry_capacity(max_model_len, ratio) if fp8 and ratio else None
    if role.is_kv_source:
        cache = _compress_and_publish(p["compressor"], p["indexer"], cache, x_all, kv_rows, cfg, ratio, fake_quant, cap)
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
            ids, made = index_select(
                iq.astype(F32),
                head_w,
                source["index_keys"],
                rows,
                ratio=ratio,
                n_entries=n_entries,
                topk=cfg.index_topk,
                block_size=cfg.candidate_block_size,
                candidates=shared.get("candidates") if role.uses_candidates else None,
                make_candidates=cfg.candidate_topk_blocks if role.is_candidate_source else None,
                backend=indexer_backend,
            )
            shared["topk"] = ids
            if made is not None:
                shared["candidates"] = made
        topk = shared["topk"]
        if fp8:
            comp = mxfp8_cache.entries_kv(source["entries"], rows, cap)
        else:
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
