"""A float64 NumPy DeepSeek-V4.1 forward of one request in one pass, for the JAX model's tests.

Written from the model's definition (docs/jax-model.md, "DeepSeek-V4.1"), not from any
implementation: every position's key set comes from the planner's float64 oracle
(`planner.oracle.layer_attention`, the schedule's shared caches and top-k rows), the indexer
scores every visible entry and selects by brute force (candidate blocks at the candidate
source, top-k inside them at later index sources), the routed experts loop over tokens.
Fake quantization optional (NumPy + ml_dtypes casts). The RoPE frequencies are
`dsv4_jax.model.layers.rope_inv_freq`'s (checked against transformers by the V4 tests) and the
Engram hash ids `dsv4_jax.model.engram.EngramHasher`'s (checked by its own tests).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dsv4_jax.model.engram import EngramHasher
from dsv4_jax.model.layers import rope_inv_freq
from dsv4_jax.model.v41_checkpoint import canonical_name
from planner.oracle import layer_attention


def fake_quant_fp8(x):
    """FP8 e4m3, a UE8M0 scale per 32 (ml_dtypes' round-to-nearest-even cast), in float32."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), np.float32(1e-4))
    scale = np.exp2(np.ceil(np.log2(amax.astype(np.float64) / 448))).astype(np.float32)
    q = np.clip(b / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * scale).reshape(x.shape)


def fake_quant_fp4(x, block, e4m3):
    """FP4 e2m1 per `block` (scale e4m3(amax / 6) or UE8M0), ml_dtypes' cast, in float32."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.abs(b).max(-1, keepdims=True)
    if e4m3:
        scale = (np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(6)).astype(ml_dtypes.float8_e4m3fn)
        scale = scale.astype(np.float32)
    else:
        scale = np.exp2(np.ceil(np.log2(np.maximum(amax, 6 * 2.0**-126).astype(np.float64) / 6))).astype(np.float32)
    q = np.clip(b / scale, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (np.where(q == 0, 0, q) * scale).reshape(x.shape)


def params64(tensors: dict) -> dict:
    """Checkpoint tensors (transformers' names, float) -> {official name: float64}, experts kept per expert."""
    out = {}
    for k, v in tensors.items():
        c = canonical_name(k)
        if c is not None:
            out[c] = np.asarray(v, np.float64)
    return out


def _rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _rope(x, pos, rope, dim, inverse=False):
    freqs = np.asarray(pos, np.float64)[:, None] * rope_inv_freq(rope, dim).astype(np.float64)[None]
    cos, sin = np.cos(freqs) * rope.attention_factor, np.sin(freqs) * rope.attention_factor
    if inverse:
        sin = -sin
    shape = (len(pos),) + (1,) * (x.ndim - 2) + (dim // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    out = x.copy()
    even, odd = x[..., -dim::2], x[..., -dim + 1 :: 2]
    out[..., -dim::2] = even * cos - odd * sin
    out[..., -dim + 1 :: 2] = even * sin + odd * cos
    return out


def _mixes(P, prefix, X, cfg):
    n, eps = cfg.hc_mult, cfg.hc_eps
    flat = _rms(X.reshape(X.shape[0], -1), eps=cfg.rms_norm_eps)
    mix = flat @ P[prefix + "_fn"].T
    base, scale = P[prefix + "_base"], P[prefix + "_scale"]
    pre = 1 / (1 + np.exp(-(mix[:, :n] * scale[0] + base[:n]))) + eps
    post = 2 / (1 + np.exp(-(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])))
    c = mix[:, 2 * n :].reshape(-1, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return pre, post, c


def _silu(x):
    return x / (1 + np.exp(-x))


def _expert(P, stem, x, lim):
    gate = np.minimum(x @ P[stem + "w1.weight"].T, lim)
    up = np.clip(x @ P[stem + "w3.weight"].T, -lim, lim)
    return _silu(gate) * up


def _moe(P, i, x, cfg):
    m = f"layers.{i}.ffn."
    logits = x @ P[m + "gate.weight"].T / cfg.gate_temp
    if cfg.scoring_func == "sqrtsoftplus":
        scores = np.sqrt(np.logaddexp(0, logits))
    elif cfg.scoring_func == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = np.logaddexp(0, logits)
    k = cfg.num_experts_per_tok
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-(scores[t] + P[m + "gate.bias"]), kind="stable")[:k]
        w = scores[t, chosen]
        if cfg.norm_topk_prob and k > 1:
            w = w / (w.sum() + 1e-20)
        w = w * cfg.routed_scaling_factor
        for e, we in zip(chosen, w):
            h = we * _expert(P, f"{m}experts.{e}.", x[t : t + 1], cfg.swiglu_limit)
            out[t] += (h @ P[f"{m}experts.{e}.w2.weight"].T)[0]
    shared = _expert(P, m + "shared_experts.", x, cfg.swiglu_limit) @ P[m + "shared_experts.w2.weight"].T
    return out + shared


def _engram(P, i, X, ids, cfg):
    e = f"layers.{i}.engram."
    T, n, hid = X.shape
    rows = P[e + "embed.weight"][ids].reshape(T, -1)
    kv = rows @ P[e + "wkv.weight"].T
    key, value = kv[:, : n * hid].reshape(T, n, hid), kv[:, n * hid :]
    w = P[e + "q_weight"] * P[e + "k_weight"]
    eps = cfg.rms_norm_eps
    rstd = 1 / np.sqrt(np.mean(X * X, -1) + eps) / np.sqrt(np.mean(key * key, -1) + eps)
    dot = (X * w * key).sum(-1) * rstd * hid**-0.5
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    return X + gate[..., None] * value[:, None, :]


def _select(logits, visible, topk, candidates=None, blocks=None):
    """Brute force: (top-k ids per row, -1 padded; candidate block sets or None)."""
    T, N = logits.shape
    made = None
    if blocks is not None:
        nb, bs = blocks
        made = []
        for t in range(T):
            v = int(visible[t])
            if v == 0:
                made.append(set())
                continue
            maxima = [logits[t, b * bs : min((b + 1) * bs, v)].max() for b in range(-(-v // bs))]
            newest = (v - 1) // bs
            order = [newest] + [b for b in np.argsort(-np.array(maxima), kind="stable") if b != newest]
            made.append(set(int(b) for b in order[:nb]))
    ids = np.full((T, topk), -1, np.int64)
    for t in range(T):
        v = int(visible[t])
        cand = [j for j in range(v) if candidates is None or j // candidates[1] in candidates[0][t]]
        best = sorted(cand, key=lambda j: -logits[t, j])[:topk]
        ids[t, : len(best)] = best
    return ids, made


def forward(cfg, P, tokens, tokenizer_file=None, fake_quant: bool = False) -> np.ndarray:
    """Logits (T, vocab) float64 of one request's tokens, positions 0..T-1; `fake_quant`: the
    window KV, compressed KV and indexer q / k on their FP8 / FP4 grids (float32 values)."""
    fq8 = (lambda x: fake_quant_fp8(x).astype(np.float64)) if fake_quant else (lambda x: x)

    def fq4(x, block, e4m3=False):
        return fake_quant_fp4(x, block, e4m3).astype(np.float64) if fake_quant else x

    sched = cfg.schedule
    T = len(tokens)
    pos = np.arange(T)
    H, D, R = cfg.num_attention_heads, cfg.head_dim, cfg.rope_head_dim
    nh, dh = cfg.index_n_heads, cfg.index_head_dim
    eps = cfg.rms_norm_eps
    hash_ids = None
    if cfg.engram_layer_ids:
        hash_ids = EngramHasher(cfg, tokenizer_file, 1, T).hash_ids([0], [0], [tokens])
    X = np.repeat(P["embed.weight"][tokens][:, None, :], cfg.hc_mult, axis=1)
    pre = np.zeros((T, cfg.hc_mult))
    pre[:, 0] = 1
    comp, ikeys, topk_of, cand = {}, {}, {}, None
    for role in sched:
        i, r = role.layer_id, role.compress_ratio
        a = f"layers.{i}.attn."
        if i in cfg.engram_layer_ids:
            X = _engram(P, i, X, hash_ids[:, cfg.engram_layer_ids.index(i)], cfg)
        pa, qa, ca = _mixes(P, f"layers.{i}.hc_attn", X, cfg)
        x = _rms((pre[..., None] * X).sum(1), P[f"layers.{i}.attn_norm.weight"], eps)
        rope = cfg.rope_compress if r else cfg.rope_main
        q_res = _rms(x @ P[a + "wq_a.weight"].T, P[a + "q_norm.weight"], eps)
        q = _rope((q_res @ P[a + "wq_b.weight"].T).reshape(T, H, D), pos, rope, R)
        kv = fq8(_rope(_rms(x @ P[a + "wkv.weight"].T, P[a + "kv_norm.weight"], eps), pos, rope, R))
        if role.is_kv_source:
            c = a + "compressor."
            E = T // r
            if r == 1:
                latent = _rms(x @ P[c + "wkv.weight"].T, P[c + "norm.weight"], eps)
            else:
                kvp, g = x @ P[c + "wkv.weight"].T, x @ P[c + "wgate.weight"].T
                kvp, g = kvp[: E * r].reshape(E, r, D), g[: E * r].reshape(E, r, D)
                w = np.exp(g - g.max(1, keepdims=True))
                latent = _rms((kvp * w / w.sum(1, keepdims=True)).sum(1), P[c + "norm.weight"], eps)
            epos = np.arange(E) * r
            comp[i] = fq4(_rope(latent, epos, cfg.rope_compress, R), 16, True)
            k = _rms(latent @ P[a + "indexer.wk.weight"].T, P[a + "indexer.k_norm.weight"], eps)
            ikeys[i] = fq4(_rope(k, epos, cfg.rope_compress, R), 32)
        if role.is_index_source:
            src = role.kv_source_layer_id
            iq = fq4(_rope((q_res @ P[a + "indexer.wq_b.weight"].T).reshape(T, nh, dh), pos, cfg.rope_compress, R), 32)
            hw = x @ P[a + "indexer.weights_proj.weight"].T * nh**-0.5
            keys = ikeys[src]
            s = np.maximum(np.einsum("thd,nd->thn", iq, keys), 0) * dh**-0.5
            logits = (s * hw[:, :, None]).sum(1)
            visible = (pos + 1) // r
            blocks = (cfg.candidate_topk_blocks, cfg.candidate_block_size) if role.is_candidate_source else None
            use = (cand, cfg.candidate_block_size) if role.uses_candidates else None
            topk_of[i], made = _select(logits, visible, cfg.index_topk, use, blocks)
            if made is not None:
                cand = made
        out, _, _ = layer_attention(
            sched,
            i,
            q,
            [kv],
            {role.kv_source_layer_id: [comp[role.kv_source_layer_id]]} if r else None,
            [T],
            [T],
            sm_scale=D**-0.5,
            attn_sink=P[a + "attn_sink"],
            topk_rows={role.index_source_layer_id: topk_of[role.index_source_layer_id]} if r else None,
            replay=False,
            allow_invalid=True,
        )[1:]
        out = _rope(out, pos, rope, R, inverse=True)
        G = cfg.o_groups
        wo_a = P[a + "wo_a.weight"].reshape(G, -1, H * D // G)
        y = np.einsum("tgi,goi->tgo", out.reshape(T, G, -1), wo_a).reshape(T, -1) @ P[a + "wo_b.weight"].T
        X = qa[..., None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", ca, X)
        pf, qf, cf = _mixes(P, f"layers.{i}.hc_ffn", X, cfg)
        x = _rms((pa[..., None] * X).sum(1), P[f"layers.{i}.ffn_norm.weight"], eps)
        y = _moe(P, i, x, cfg)
        X = qf[..., None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", cf, X)
        pre = pf
    h = _rms((pre[..., None] * X).sum(1), P["norm.weight"], eps)
    return h @ P["head.weight"].T
