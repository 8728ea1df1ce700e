"""The model's small pieces: linear, RMSNorm, RoPE, mHC (Sinkhorn), the MoE (notes sections 4, 11)
and the vocabulary-parallel embedding.

Weights are plain arrays or `dsv4_jax.model.quant.QuantizedWeight`s (FP8 / FP4 as shipped), which
`linear` and the MoE dequantize inside the jitted program. With a mesh (`mesh`, `axis` arguments;
`dsv4_jax.model.parallel` says what is split), the routed experts run expert-parallel and the
embedding vocabulary-parallel in `shard_map`s; the dense matmuls are left to XLA's partitioner.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dsv4_jax.model.config import ModelConfig, RopeConfig
from dsv4_jax.model.quant import dense

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST

# ----------------------------------------------------------------------------- small pieces


def linear(x, w):
    """x (..., in) @ w (out, in).T in x's dtype, float32 accumulation (torch's F.linear).

    w: a plain array (cast to x's dtype) or a `QuantizedWeight` (dequantized blockwise to x's dtype
    right here, inside the caller's jit: exact for E8M0 scales, so both give the same numbers)."""
    y = jnp.einsum("...i,oi->...o", x, dense(w, x.dtype), precision=HIGHEST, preferred_element_type=F32)
    return y.astype(x.dtype)


def embed_lookup(embed, token_ids, dtype, mesh=None, axis=None):
    """Rows of the embedding (V, hidden) in `dtype`. With a mesh the table is split on V over
    `axis`: each device gathers the ids it holds (zeros elsewhere) and a psum adds them (exact)."""
    if mesh is None:
        return embed[token_ids].astype(dtype)

    def local(table, ids):
        rows = table.shape[0]
        i = ids - lax.axis_index(axis) * rows
        mine = (i >= 0) & (i < rows)
        x = table[jnp.clip(i, 0, rows - 1)].astype(dtype)
        return lax.psum(jnp.where(mine[:, None], x, jnp.zeros((), dtype)), axis)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P()), out_specs=P(), check_vma=False)(embed, token_ids)


def rms_norm(x, weight, eps):
    """Weighted RMSNorm (section 5): float32 inside, weight float32, cast back once."""
    xf = x.astype(F32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(F32) * xf).astype(x.dtype)


def rms_norm_unweighted(x, eps):
    """x * rsqrt(mean(x^2) + eps): the factor in float32, the product in x's dtype."""
    xf = x.astype(F32)
    return x * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps).astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """(dim/2,) float32 inverse frequencies, computed in float32 like transformers (section 6)."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(rope.theta), exponents, dtype=np.float32)
    if rope.rope_type == "default":
        return (np.float32(1.0) / pos_freqs).astype(np.float32)
    factor = rope.factor
    orig = rope.original_max_position_embeddings
    if factor is None:
        raise ValueError("rope_parameters: YaRN needs a 'factor'")

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)  # transformers always truncates here
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1) - ramp).astype(np.float32)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    return (inv_inter * (np.float32(1) - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def rope_cos_sin(positions, rope: RopeConfig, dim: int):
    """cos, sin (..., dim/2) float32 at integer positions."""
    freqs = positions.astype(F32)[..., None] * jnp.asarray(rope_inv_freq(rope, dim))
    return jnp.cos(freqs) * rope.attention_factor, jnp.sin(freqs) * rope.attention_factor


def apply_rope(x, cos, sin):
    """Interleaved RoPE on the trailing 2*cos.shape[-1] dims of x (section 6), in float32.

    x (..., D); cos, sin broadcastable to (..., R/2). Pass -sin for the inverse rotation.
    """
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:].astype(F32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)


# ----------------------------------------------------------------------------- mHC (section 4)


def hyper_pre(p, X, cfg: ModelConfig):
    """Mixing weights of one mHC site and the collapsed block input.

    X (T, n, hidden) -> post (T, n) f32, comb (T, n, n) f32 (comb[j, k]: stream j -> k), x (T, hidden).
    """
    n, eps = cfg.hc_mult, cfg.hc_eps
    flat = rms_norm_unweighted(X.reshape(X.shape[0], -1).astype(F32), cfg.rms_norm_eps)
    mix = jnp.einsum("ti,oi->to", flat, p["fn"].astype(F32), precision=HIGHEST)
    base, scale = p["base"].astype(F32), p["scale"].astype(F32)
    pre = jax.nn.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * jax.nn.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = mix[:, 2 * n :].reshape(-1, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    comb = jax.nn.softmax(comb, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)  # one column step, then (row, column) pairs

    def row_then_column(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    comb = lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, row_then_column, comb)  # a loop: compiles fast
    x = (pre[..., None] * X).sum(axis=1).astype(X.dtype)
    return post, comb, x


def hyper_post(X, y, post, comb):
    """X_k <- post_k * y + sum_j comb[j, k] X_j."""
    dt = X.dtype
    mixed = jnp.einsum("tjk,tjd->tkd", comb.astype(dt), X, precision=HIGHEST)
    return post.astype(dt)[..., None] * y[:, None, :] + mixed


def hyper_head(p, X, cfg: ModelConfig):
    """Final stream collapse (`DeepseekV4HyperHead`): X (R, n, hidden) -> (R, hidden)."""
    flat = rms_norm_unweighted(X.reshape(X.shape[0], -1).astype(F32), cfg.rms_norm_eps)
    mix = jnp.einsum("ti,oi->to", flat, p["fn"].astype(F32), precision=HIGHEST)
    pre = jax.nn.sigmoid(mix * p["scale"].astype(F32) + p["base"].astype(F32)) + cfg.hc_eps
    return (pre[..., None] * X).sum(axis=1).astype(X.dtype)


# ----------------------------------------------------------------------------- MoE (section 11)


def _score(logits, func: str):
    if func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if func == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softplus(logits)


def _swiglu(gate, up, limit):
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


_EXPERT_DOT = lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


# The routed experts' grouped matmul: two lowerings of the same products (float32 accumulation).
# "ragged_dot": one `lax.ragged_dot_general` (XLA's grouped matmul; what TPU / GPU run well).
# "dense_tiles": a loop over tiles of EXPERT_TILE rows of one expert each, a dense dot per tile;
# on XLA's CPU backend about 7x faster at V4.1's expert widths (ragged_dot there is a slow
# generic loop: docs/benchmarks.md, "The routed experts' grouped matmul on CPU").
# "auto": "dense_tiles" on the CPU, "ragged_dot" elsewhere.
EXPERT_MATMULS = ("auto", "ragged_dot", "dense_tiles")
EXPERT_TILE = 128


def resolve_expert_matmul(name: str, platform: str | None = None) -> str:
    """The grouped-matmul lowering `name` ("auto" or one of EXPERT_MATMULS) runs as on `platform`
    (default: JAX's default backend)."""
    if name not in EXPERT_MATMULS:
        raise ValueError(f"expert_matmul: expected one of {EXPERT_MATMULS}, got {name!r}")
    if name != "auto":
        return name
    return "dense_tiles" if (platform or jax.default_backend()) == "cpu" else "ragged_dot"


def _grouped_tiles(x, w, sizes, precision):
    """`_grouped` as dense tiles: groups are contiguous runs of rows; each tile is min(EXPERT_TILE,
    pow2 >= rows) rows of one group (a group's last tile is partly masked), one dot per tile in a
    loop over the tiles that hold rows (at most cdiv(m, tile) + groups). Memory O(m)."""
    m = x.shape[0]
    tile = int(min(EXPERT_TILE, max(8, 1 << max(m - 1, 0).bit_length())))
    ntiles = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(ntiles)
    group_start = jnp.cumsum(sizes) - sizes
    xp = jnp.pad(x, ((0, tile), (0, 0)))  # a tile starting at any row stays inside (no clamping)
    out = jnp.zeros((m + tile, w.shape[1]), F32)

    def body(i, out):
        e = jnp.searchsorted(tile_end, i, side="right").astype(jnp.int32)
        j = i - (tile_end[e] - ntiles[e])  # tile j of group e
        start = group_start[e] + j * tile
        xt = lax.dynamic_slice_in_dim(xp, start, tile)
        yt = jnp.einsum("ti,oi->to", xt, w[e], precision=precision, preferred_element_type=F32)
        live = (jnp.arange(tile) + j * tile < sizes[e])[:, None]
        old = lax.dynamic_slice_in_dim(out, start, tile)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(live, yt, old), start, 0)

    out = lax.fori_loop(0, tile_end[-1], body, out)
    return out[:m]


def _grouped(x, w, sizes, method: str = "ragged_dot"):
    """Rows of x (m, in), grouped contiguously by `sizes` (rows past sum(sizes): zeros), times
    their group's w (g, out, in).T, float32; `method` one of EXPERT_MATMULS but "auto".

    HIGHEST for float32 rows only: bf16 products are exact anyway, and XLA's TPU ragged-dot kernel
    refuses an fp32-precision contraction of bf16 operands (found compiling V4 for TPU slices)."""
    precision = HIGHEST if x.dtype == F32 else lax.Precision.DEFAULT
    if method == "dense_tiles":
        return _grouped_tiles(x, w, sizes, precision)
    if method != "ragged_dot":
        raise ValueError(f"expert_matmul: expected 'ragged_dot' or 'dense_tiles' here, got {method!r}")
    return lax.ragged_dot_general(x, w, sizes, _EXPERT_DOT, precision=precision, preferred_element_type=F32)


def routed_experts(x, experts, weights, w13, w2, limit, first=0, method: str = "ragged_dot"):
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) over the experts held here.

    x (T, hidden); experts, weights (T, k); w13 (E_here, 2I, hidden), w2 (E_here, hidden, I), plain
    or quantized, holding experts first .. first + E_here - 1 (all of them on one device). Pairs
    with other experts contribute zero: with expert parallelism a psum over devices completes it.
    """
    k = experts.shape[1]
    here = w13.shape[0]
    local = experts - first
    mine = (local >= 0) & (local < here)
    # Sort the (token, expert) pairs by expert, pairs of other devices last: two grouped matmuls.
    flat = jnp.where(mine, local, here).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=here + 1)[:here].astype(jnp.int32)
    h = _grouped(x[token], dense(w13, x.dtype), sizes, method)
    inter = h.shape[-1] // 2
    act = _swiglu(h[:, :inter], h[:, inter:], limit).astype(x.dtype)
    out = _grouped(act, dense(w2, x.dtype), sizes, method).astype(x.dtype)
    w = weights.reshape(-1)[order].astype(x.dtype)
    out = jnp.where(mine.reshape(-1)[order][:, None], out * w[:, None], jnp.zeros((), x.dtype))
    return jnp.zeros_like(x).at[token].add(out)


def moe(p, x, hash_experts, use_hash, cfg: ModelConfig, mesh=None, axis=None, expert_matmul: str = "ragged_dot"):
    """Routed experts + the shared expert: x (T, hidden) -> (T, hidden).

    Hash layers (use_hash true) take their experts from hash_experts (T, k) = tid2eid[token_ids];
    the others route by top-k of score + bias. A traced flag, so both kinds share one program.
    With a mesh the experts are split over `axis` (expert parallelism): each device runs its
    experts on every token routed to them and a psum adds the devices' parts. expert_matmul: the
    grouped matmul's lowering (one of EXPERT_MATMULS but "auto": the model resolves it).
    """
    k, limit = cfg.num_experts_per_tok, cfg.swiglu_limit
    scores = _score(linear(x, p["gate"]), cfg.scoring_func)
    top = lax.top_k(scores.astype(F32) + p["bias"].astype(F32), k)[1]
    experts = jnp.where(use_hash, hash_experts, top)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor

    if mesh is None:
        routed = routed_experts(x, experts, weights, p["w13"], p["w2"], limit, method=expert_matmul)
    else:

        def per_device(x, experts, weights, w13, w2):
            first = lax.axis_index(axis) * w13.shape[0]
            return lax.psum(routed_experts(x, experts, weights, w13, w2, limit, first, expert_matmul), axis)

        routed = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), P(), P(), P(axis), P(axis)), out_specs=P(), check_vma=False
        )(x, experts, weights, p["w13"], p["w2"])

    shared = _swiglu(linear(x, p["shared_w1"]), linear(x, p["shared_w3"]), limit)
    return routed + linear(shared, p["shared_w2"])
