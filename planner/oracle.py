"""Float64 NumPy oracle of DeepSeek-V4 sparse attention (spec sections 1 and 2).

References, chunk-free and slow on purpose:

* `sparse_attention`: the FlashMLA `flash_mla_sparse_fwd` contract on a flat workspace.
* `key_set`: one query's keys by definition (spec section 1; DeepSeek-V4.1's ratio 2 / ratio 1
  visibility, its top-k rows and clamped windows).
* `prefill_attention`: per-request attention straight from the logical (unpaged) raw and
  compressed KV, each query's keys from `key_set`. It never looks at a plan, so "gather by plan +
  sparse_attention == prefill_attention" proves the plan and layout right.
* `layer_attention`: one V4.1 layer as its `planner.Schedule` wires it: its KV source's shared
  compressed cache, its index source's top-k, its band's rows and window starts.
"""

from __future__ import annotations

import numpy as np

from planner.checks import as_int, as_int_vector, sm_scale_value, sparse_attention_shapes
from planner.contract import LayerKind, LayerSpec, value_dim


def _as_float_array(x, name: str, ndim: tuple[int, ...] | None = None) -> np.ndarray:
    try:
        a = np.asarray(x)
    except Exception as e:  # pragma: no cover - exotic inputs
        raise TypeError(f"{name}: cannot be converted to an array ({e})") from None
    if a.dtype.kind not in "fiu" and str(a.dtype) != "bfloat16":
        raise TypeError(f"{name}: expected a numeric array, got dtype {a.dtype}")
    if ndim is not None and a.ndim not in ndim:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndim))} dims, got shape {a.shape}")
    return a.astype(np.float64)


def sparse_attention(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    """FlashMLA sparse attention, float64.

    Args:
      q: (T, H, D) float.
      kv: (S, D) or (S, 1, D) float: the flat workspace (K = V = the row; V is its first d_v dims,
        d_v = 512 when D >= 512, else D).
      indices: (T, K) or (T, 1, K) integer. An entry is invalid if negative, >= S, or if its
        column is >= topk_length[t].
      sm_scale: float, the softmax scale applied to <q, k>.
      attn_sink: optional (H,) float: one logit per head that joins the softmax denominator only.
        -inf means no sink.
      topk_length: optional (T,) integer: entries at columns >= topk_length[t] are invalid.

    Returns:
      out: (T, H, d_v) float64; 0 for rows with no valid key.
      max_logits: (T, H) float64, max of sm_scale * <q, k> over valid keys; -inf if none.
      lse: (T, H) float64, natural-log sum-exp of the same logits (sink excluded); +inf if none.
    """
    q = _as_float_array(q, "q")
    kv = _as_float_array(kv, "kv")
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"indices: expected an integer array, got dtype {idx.dtype}")
    sink = None if attn_sink is None else _as_float_array(attn_sink, "attn_sink")
    tl = None if topk_length is None else np.asarray(topk_length)
    T, H, D, S, K, squeeze_kv, squeeze_idx = sparse_attention_shapes(
        q.shape, kv.shape, idx.shape, None if sink is None else sink.shape, None if tl is None else tl.shape
    )
    sm_scale = sm_scale_value(sm_scale)
    kv = kv[:, 0] if squeeze_kv else kv
    idx = (idx[:, 0] if squeeze_idx else idx).astype(np.int64)
    valid = (idx >= 0) & (idx < S)
    if tl is not None:
        valid &= np.arange(K)[None, :] < as_int_vector(tl, "topk_length")[:, None]
    d_v = value_dim(D)

    out = np.zeros((T, H, d_v))
    max_logits = np.full((T, H), -np.inf)
    lse = np.full((T, H), np.inf)
    for t in range(T):  # a row at a time keeps memory at K * D per token
        keys = kv[idx[t, valid[t]]]  # (k, D); duplicated indices count twice, as in FlashMLA
        if keys.shape[0] == 0:
            continue
        logits = sm_scale * (q[t] @ keys.T)  # (H, k)
        m = logits.max(axis=1)
        p = np.exp(logits - m[:, None])
        denom = p.sum(axis=1)
        o = (p @ keys[:, :d_v]) / denom[:, None]
        max_logits[t] = m
        lse[t] = m + np.log(denom)
        if sink is not None:
            # exp(lse) / (exp(lse) + exp(sink)), written to avoid overflow for large sinks.
            o = o / (1.0 + np.exp(sink - lse[t]))[:, None]
        out[t] = o
    return out, max_logits, lse


def key_set(
    position: int,
    *,
    kind,
    compress_ratio: int,
    window_size: int,
    topk_row=None,
    window_start: int = 0,
    allow_invalid: bool = False,
):
    """The keys of the query at absolute `position` (spec section 1; DeepSeek-V4.1's rows), by definition.

    Returns (compressed, window): lists of compressed entry ids and of raw positions, in vLLM's
    row order. Entry w pools tokens r*w .. r*w + r - 1 and is visible iff w < (p + 1) // r (ratio
    2: w < (p + 1) // 2; ratio 1: w <= p, the query's own token included).
    * compressed: SWA none; HCA every visible entry; CSA the first min((p + 1) // r, topk) of
      `topk_row` (the index source's request-local top-k; each must be visible, or -1 with
      `allow_invalid`, kept as -1: no key, as vLLM V4.1 keeps a failed pick).
    * window: positions max(0, p - W + 1, window_start) .. p (`window_start`: the request's
      `replay_start`, or the replay band's clamp, `PrefillBatch.band`).
    """
    layer = LayerSpec(LayerKind.of(kind), compress_ratio)
    p, W = int(position), as_int(window_size, "window_size", minimum=1)
    visible = (p + 1) // layer.compress_ratio if layer.has_compressed else 0
    if layer.kind is LayerKind.CSA:
        if topk_row is None:
            raise ValueError("topk_row: required for CSA layers")
        row = np.asarray(topk_row, dtype=np.int64).reshape(-1)
        compressed = row[: min(visible, row.shape[0])].tolist()
        bad = [e for e in compressed if not (0 <= e < visible or (allow_invalid and e == -1))]
        if bad:
            raise ValueError(f"topk_rows: position {p} points at entries outside 0..{visible - 1}: {compressed}")
    else:
        compressed = list(range(visible))
    return compressed, list(range(max(0, p - W + 1, int(window_start)), p + 1))


def prefill_attention(
    q,
    raw_kv,
    compressed_kv,
    seq_lens,
    query_lens,
    *,
    kind,
    compress_ratio: int,
    window_size: int,
    sm_scale: float,
    attn_sink=None,
    topk_rows=None,
    window_starts=None,
    allow_invalid: bool = False,
):
    """Chunk-free prefill attention from each request's logical KV (spec section 1).

    Args:
      q: (T, H, D) float: the query tokens of all requests, request-major (request 0's
        query_lens[0] tokens first). Token j of request i sits at absolute position
        seq_lens[i] - query_lens[i] + j.
      raw_kv: sequence of per-request (seq_lens[i], D) arrays: the latent of every raw token.
      compressed_kv: sequence of per-request (seq_lens[i] // r, D) arrays (entry w summarises
        tokens r*w .. r*w+r-1); ignored (may be None) for SWA layers.
      seq_lens, query_lens: (B,) integers.
      kind: the layer kind (`LayerKind` or its name): SWA, CSA (top-k) or HCA (dense).
      compress_ratio: the layer's ratio r (any r >= 1 for CSA/HCA; ignored for SWA).
      window_size: W, the sliding window (the query itself included).
      sm_scale: float.
      attn_sink: optional (H,) float.
      topk_rows: CSA only, (T, topk) integers: the indexer's request-local top-k row of each
        query token. The first min((p+1)//r, topk) entries are used; they must be visible.
      window_starts: optional (B,) integers: no window of request i reaches below position
        window_starts[i] (`key_set`'s `window_start`); default 0.
      allow_invalid: CSA: -1 among the used top-k entries is no key (V4.1), not an error.

    Returns:
      (out, max_logits, lse) as `sparse_attention`, for the T query tokens.
    """
    from planner.batch import PrefillBatch

    layer = LayerSpec(LayerKind.of(kind), compress_ratio)
    kind = layer.kind
    batch = PrefillBatch(seq_lens, query_lens)
    q = _as_float_array(q, "q", (3,))
    if q.shape[0] != batch.num_tokens:
        raise ValueError(f"q: {q.shape[0]} tokens, but query_lens sum to {batch.num_tokens}")
    if len(raw_kv) != batch.num_requests:
        raise ValueError(f"raw_kv: {len(raw_kv)} requests, expected {batch.num_requests}")
    if kind is not LayerKind.SWA and (compressed_kv is None or len(compressed_kv) != batch.num_requests):
        raise ValueError(f"compressed_kv: expected {batch.num_requests} per-request arrays for a {kind.name} layer")
    W, r = as_int(window_size, "window_size", minimum=1), layer.compress_ratio
    if kind is LayerKind.CSA:
        if topk_rows is None:
            raise ValueError("topk_rows: required for CSA layers")
        topk_rows = np.asarray(topk_rows)
        if topk_rows.ndim != 2 or topk_rows.shape[0] != batch.num_tokens:
            raise ValueError(f"topk_rows: expected ({batch.num_tokens}, topk), got {topk_rows.shape}")
    starts = np.zeros(batch.num_requests, dtype=np.int64)
    if window_starts is not None:
        starts = as_int_vector(window_starts, "window_starts")
        if starts.shape != (batch.num_requests,):
            raise ValueError(f"window_starts: expected ({batch.num_requests},), got {starts.shape}")

    outs, maxes, lses = [], [], []
    for i in range(batch.num_requests):
        seq_len, qlen = int(batch.seq_lens[i]), int(batch.query_lens[i])
        if qlen == 0:
            continue
        t0 = int(batch.query_start_loc[i])
        raw = _as_float_array(raw_kv[i], f"raw_kv[{i}]", (2,))
        if raw.shape[0] < seq_len:
            raise ValueError(f"raw_kv[{i}]: {raw.shape[0]} rows for seq_len {seq_len}")
        comp = np.zeros((0, raw.shape[1]))
        if kind is not LayerKind.SWA:
            comp = _as_float_array(compressed_kv[i], f"compressed_kv[{i}]", (2,))
            if comp.shape[0] < seq_len // r:
                raise ValueError(f"compressed_kv[{i}]: {comp.shape[0]} rows, expected {seq_len // r}")
        keys = np.concatenate([comp, raw[:seq_len]])  # entries first, then raw tokens
        n_comp = comp.shape[0]
        rows = []
        for j in range(qlen):
            compressed, window = key_set(
                seq_len - qlen + j,
                kind=kind,
                compress_ratio=r,
                window_size=W,
                topk_row=None if topk_rows is None else topk_rows[t0 + j],
                window_start=int(starts[i]),
                allow_invalid=allow_invalid,
            )
            rows.append(compressed + [n_comp + w for w in window])  # -1 stays invalid
        width = max(1, max(len(row) for row in rows))
        idx = np.full((qlen, width), -1, dtype=np.int64)
        for j, row in enumerate(rows):
            idx[j, : len(row)] = row
        o, m, l = sparse_attention(q[t0 : t0 + qlen], keys, idx, sm_scale, attn_sink)
        outs.append(o)
        maxes.append(m)
        lses.append(l)
    H, D = q.shape[1], q.shape[2]
    if not outs:
        return np.zeros((0, H, value_dim(D))), np.zeros((0, H)), np.zeros((0, H))
    return np.concatenate(outs), np.concatenate(maxes), np.concatenate(lses)


def layer_attention(
    schedule,
    layer_id: int,
    q,
    raw_kv,
    compressed_kv,
    seq_lens,
    query_lens,
    *,
    sm_scale: float,
    attn_sink=None,
    topk_rows=None,
    replay: bool | None = False,
    replay_start=None,
    allow_invalid: bool = False,
):
    """One DeepSeek-V4.1 layer's prefill attention, chunk-free, as its schedule wires it.

    Args:
      schedule: the model's `planner.Schedule`; layer_id: the layer.
      q: (T, H, D) float, the layer's queries for every new token of the step (request-major);
        only the rows of the layer's band are read.
      raw_kv: per-request (seq_lens[i], D) arrays: this layer's own window latents.
      compressed_kv: {kv_source_layer_id: per-request (seq_lens[i] // r, D) arrays}: the shared
        compressed caches; the layer reads its KV source's (ignored for ratio 0).
      seq_lens, query_lens: (B,) integers.
      topk_rows: {index_source_layer_id: (T, topk) integers}: each index source's request-local
        top-k rows for the step's tokens; the layer uses its index source's (ignored for ratio 0).
      replay: decoder bounded replay (`Schedule.resolve_replay`: None = vLLM's default, False =
        every row with full windows, as transformers computes).
      replay_start: optional (B,) integers, the batch's `PrefillBatch.replay_start`.

    Returns:
      token_index: (T_band,) int32, the step rows the layer computes (`PrefillBatch.band`);
      out, max_logits, lse: as `prefill_attention`, for those rows.
    """
    from planner.batch import PrefillBatch

    role = schedule[layer_id]
    band = role.band(schedule.resolve_replay(replay))
    batch = PrefillBatch(seq_lens, query_lens, replay_start=replay_start)
    rows = batch.band(band, schedule.sliding_window)
    q = _as_float_array(q, "q", (3,))
    if q.shape[0] != batch.num_tokens:
        raise ValueError(f"q: {q.shape[0]} tokens, but query_lens sum to {batch.num_tokens}")
    comp, sel = None, None
    if role.has_compressed:
        for name, table, key in (
            ("compressed_kv", compressed_kv, role.kv_source_layer_id),
            ("topk_rows", topk_rows, role.index_source_layer_id),
        ):
            if not isinstance(table, dict) or key not in table:
                raise ValueError(f"{name}: layer {layer_id} reads layer {key}'s; expected a dict holding it")
        comp = compressed_kv[role.kv_source_layer_id]
        sel = np.asarray(topk_rows[role.index_source_layer_id])
        if sel.ndim != 2 or sel.shape[0] != batch.num_tokens:
            raise ValueError(
                f"topk_rows[{role.index_source_layer_id}]: expected ({batch.num_tokens}, topk), got {sel.shape}"
            )
        sel = sel[rows.token_index]
    spec = role.spec
    out = prefill_attention(
        q[rows.token_index],
        raw_kv,
        comp,
        batch.seq_lens,
        rows.query_lens,
        kind=spec.kind,
        compress_ratio=spec.compress_ratio,
        window_size=schedule.sliding_window,
        sm_scale=sm_scale,
        attn_sink=attn_sink,
        topk_rows=sel,
        window_starts=rows.window_starts,
        allow_invalid=allow_invalid,
    )
    return (rows.token_index, *out)
