"""DeepSeek-V4.1's blocks around the attention (`dsv4_jax.model.v41`): single-pass mHC (each site's
pre / post / comb from one projection of the streams), the V4.1 MoE (top-k routing with a router
temperature, the routing weight applied before the down projection; the routed experts' grouped
matmul lowered as `dsv4_jax.model.layers.EXPERT_MATMULS` says) and Engram (gated n-gram table rows
added to the streams before their layer's block). transformers' `DeepseekV41ForCausalLM` math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dsv4_jax.model.layers import _grouped, _score, _swiglu, linear, rms_norm_unweighted
from dsv4_jax.model.quant import QuantizedWeight, dense, dequantize
from dsv4_jax.model.v41_config import V41Config

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST

# ----------------------------------------------------------------------------- mHC, MoE, Engram


def hc_mixes(p, X, cfg: V41Config):
    """One mHC site: X (T, n, hidden) -> pre, post (T, n), comb (T, n, n) float32 (comb[j, k]:
    stream j -> k, Sinkhorn-projected), from one projection of the normalized flat streams."""
    n, eps = cfg.hc_mult, cfg.hc_eps
    flat = rms_norm_unweighted(X.reshape(X.shape[0], -1).astype(F32), cfg.rms_norm_eps)
    mix = jnp.einsum("ti,oi->to", flat, p["fn"].astype(F32), precision=HIGHEST)
    base, scale = p["base"].astype(F32), p["scale"].astype(F32)
    pre = jax.nn.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * jax.nn.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = mix[:, 2 * n :].reshape(-1, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    comb = jax.nn.softmax(comb, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)

    def row_then_column(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    comb = lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, row_then_column, comb)
    return pre, post, comb


def hc_collapse(X, pre):
    """sum_k pre_k X_k in float32, cast back: the sublayer input."""
    return (pre[..., None] * X.astype(F32)).sum(axis=1).astype(X.dtype)


def hc_expand(y, X, post, comb):
    """X_k <- post_k * y + sum_j comb[j, k] X_j (float32 inside)."""
    mixed = jnp.einsum("tjk,tjd->tkd", comb, X.astype(F32), precision=HIGHEST)
    return (post[..., None] * y.astype(F32)[:, None, :] + mixed).astype(X.dtype)


def routed_experts_v41(x, experts, weights, w13, w2, limit, first=0, method: str = "ragged_dot"):
    """sum_k w2(weights[t, k] * swiglu(w13 x)) over the experts held here (the weight applied
    before the down projection, as transformers' V4.1 expert does); float32 (T, hidden).
    method: the grouped matmul's lowering (`dsv4_jax.model.layers.EXPERT_MATMULS`)."""
    k = experts.shape[1]
    here = w13.shape[0]
    local = experts - first
    mine = (local >= 0) & (local < here)
    flat = jnp.where(mine, local, here).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=here + 1)[:here].astype(jnp.int32)
    h = _grouped(x[token], dense(w13, x.dtype), sizes, method).astype(x.dtype).astype(F32)
    inter = h.shape[-1] // 2
    w = weights.reshape(-1)[order].astype(F32)
    act = (_swiglu(h[:, :inter], h[:, inter:], limit) * w[:, None]).astype(x.dtype)
    out = _grouped(act, dense(w2, x.dtype), sizes, method).astype(x.dtype).astype(F32)
    out = jnp.where(mine.reshape(-1)[order][:, None], out, 0.0)
    return jnp.zeros(x.shape, F32).at[token].add(out)


def moe_v41(p, x, cfg: V41Config, mesh=None, axis=None, expert_matmul: str = "ragged_dot"):
    """Routed experts (top-k of score + bias; weights from the unbiased scores, normalized,
    scaled) + the shared expert: x (T, hidden) -> (T, hidden). expert_matmul: the grouped
    matmul's lowering (resolved by the model)."""
    k, limit = cfg.num_experts_per_tok, cfg.swiglu_limit
    scores = _score(linear(x.astype(F32), p["gate"]) / F32(cfg.gate_temp), cfg.scoring_func)
    experts = lax.top_k(scores + p["bias"].astype(F32), k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    weights = weights * F32(cfg.routed_scaling_factor)
    if mesh is None:
        routed = routed_experts_v41(x, experts, weights, p["w13"], p["w2"], limit, method=expert_matmul)
    else:

        def per_device(x, experts, weights, w13, w2):
            first = lax.axis_index(axis) * w13.shape[0]
            return lax.psum(routed_experts_v41(x, experts, weights, w13, w2, limit, first, expert_matmul), axis)

        routed = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), P(), P(), P(axis), P(axis)), out_specs=P(), check_vma=False
        )(x, experts, weights, p["w13"], p["w2"])
    gate = linear(x, p["shared_w1"]).astype(F32)
    up = linear(x, p["shared_w3"]).astype(F32)
    shared = linear(_swiglu(gate, up, limit).astype(x.dtype), p["shared_w2"]).astype(F32)
    return (routed + shared).astype(x.dtype)


def engram_v41(p, X, hash_ids, cfg: V41Config):
    """Engram: the streams X (T, n, hidden) plus each stream's gated value of the n-gram rows."""
    table = p["embed"]
    if isinstance(table, QuantizedWeight):  # FP8 rows with a UE8M0 scale per 32 dims
        rows = dequantize(QuantizedWeight(table.data[hash_ids], table.scale[hash_ids], table.fmt, table.block), F32)
    else:
        rows = table[hash_ids]
    T, n, hid = X.shape
    kv = linear(rows.reshape(T, -1).astype(X.dtype), p["wkv"])
    key = kv[:, : n * hid].astype(F32).reshape(T, n, hid)
    value = kv[:, n * hid :].astype(F32)
    weight = p["q_weight"].astype(F32) * p["k_weight"].astype(F32)
    h = X.astype(F32)
    eps = cfg.rms_norm_eps
    rstd = lax.rsqrt(jnp.mean(h * h, axis=-1) + eps) * lax.rsqrt(jnp.mean(key * key, axis=-1) + eps)
    dot = (h * weight * key).sum(axis=-1) * rstd * F32(hid**-0.5)
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), F32(1e-6))), dot))
    return (h + gate[..., None] * value[:, None, :]).astype(X.dtype)


__all__ = ["engram_v41", "hc_collapse", "hc_expand", "hc_mixes", "moe_v41", "routed_experts_v41"]
