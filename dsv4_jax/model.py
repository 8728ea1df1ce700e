"""DeepSeek-V4 in JAX, on the dsv4-prefill attention path. One file, read top to bottom.

The math is transformers' `DeepseekV4ForCausalLM` (docs/transformers-dsv4.md, section numbers
below refer to it); the attention core is the planner + `dsv4_jax.prefill.prefill_attention`
(which calls `dsv4_jax.sparse_attention`, "xla" or "pallas").

Batches are ragged: one call (a *step*) takes any number of requests, each with its own cache
slot, context length (`prefix`) and new tokens (`query_len` >= 1). The new tokens of all
requests are flattened request-major into one token axis; a one-call prefill, a chunk of a
chunked prefill and a decode step (query_len 1) are the same computation. Nothing pads a
request: per-token work is per token, and every per-request state lives in its own slot.

Per-request caches (`init_cache`), one dict per layer, slot-major (`S` = max_batch_size):
  window      (S, W-1, D)   ring of the last W-1 raw latents: position q at row q % (W-1)
  entries     (S, cdiv(max_model_len, r), D)            CSA/HCA: compressed entries, by id
  ring_kv, ring_gate (S, 2r or r, C)                    CSA/HCA: the compressor's projected kv
                gate of the last 2r (CSA: the ratio-4 overlap needs the previous block) or r
                (HCA) positions, ring-indexed like the window. Unfinished blocks wait here.
  index_entries, index_ring_kv, index_ring_gate         CSA: the same for the indexer (width 128)
Rows a request has not written are never read, so a slot needs no reset between requests.

A step (`DeepseekV4.step`) plans attention once on the host (`planner.plan_step`, one plan per
layer kind, turned into device metadata by `dsv4_jax.prefill.build_step_metadata`), then runs
one jitted function per layer: compiled once per (layer kind, bucketed shapes) and shared by
every layer of that kind (hash and top-k MoE routing share it: the choice is a traced flag),
plus the jitted embedding and head. Buckets: tokens by `dsv4_jax.buckets.bucket` (or powers of
two), requests, workspace rows and indexer entries by powers of two; `compile_counts()` says
how many traces each function took.

Precision follows transformers' float32 islands: RMSNorm statistics, mHC, RoPE, gate softmaxes,
router scores and indexer scores run in float32 whatever the model dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.tree_util import register_pytree_node_class

from dsv4_jax.prefill import LogicalKV, build_step_metadata, prefill_attention
from planner import LayerKind, PlanConfig, PrefillBatch, StepPlan, layer_kind, plan_step

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
COMPILES: Counter = Counter()  # traces (= compilations) of each jitted function, by name

# ----------------------------------------------------------------------------- config

_LAYER_TYPE_RATIO_KEY = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_LEGACY_RATIO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softplus")


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE table: default (`rope_type="default"`) or YaRN, on the trailing rope dims."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None  # YaRN only
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # scales cos and sin (V4 forces 1.0 for YaRN)


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4 hyper-parameters (transformers' names; defaults = V4-Flash).

    `compress_ratios[i]` is layer i's kind as a ratio (0 SWA, 4 CSA, 128 HCA; no MTP slot);
    `mlp_layer_types[i]` is "hash_moe" or "moe". Build one with `from_name("tiny" | "V4-Flash" |
    "V4-Pro")`, `from_dict(config_json)` (both transformers' and DeepSeek's published fields)
    or `from_checkpoint(dir)`.
    """

    name: str = dataclasses.field(default="V4-Flash", compare=False)  # a label: not part of the jit key
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    compress_ratios: tuple[int, ...] = (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 43))
    mlp_layer_types: tuple[str, ...] = ("hash_moe",) * 3 + ("moe",) * 40
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_main: RopeConfig = RopeConfig()
    rope_compress: RopeConfig = RopeConfig("yarn", 160000.0, 16.0, 65536, 32.0, 1.0, 1.0)
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1

    def __post_init__(self):
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n or len(self.mlp_layer_types) != n:
            raise ValueError(
                f"compress_ratios / mlp_layer_types: need {n} entries each, got "
                f"{len(self.compress_ratios)} / {len(self.mlp_layer_types)}"
            )
        for r in self.compress_ratios:
            layer_kind(r)  # ValueError for anything but 0, 1, 4, 128
        bad = [t for t in self.mlp_layer_types if t not in ("hash_moe", "moe")]
        if bad:
            raise ValueError(f"mlp_layer_types: entries must be 'hash_moe' or 'moe', got {bad}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func: expected one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups: {self.o_groups} does not divide num_attention_heads {self.num_attention_heads}")
        if not 0 < self.rope_head_dim <= self.head_dim or self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim: expected an even value in 1..{self.head_dim}, got {self.rope_head_dim}")
        if self.index_head_dim < self.rope_head_dim:
            raise ValueError(f"index_head_dim: {self.index_head_dim} is smaller than rope_head_dim {self.rope_head_dim}")

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        return tuple(layer_kind(r) for r in self.compress_ratios)

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise ValueError(f"name: expected one of {sorted(p.name for p in PRESETS.values())}, got {name!r}")
        return PRESETS[key]

    @classmethod
    def from_checkpoint(cls, path) -> "ModelConfig":
        p = Path(path)
        if not (p / "config.json").is_file():
            raise ValueError(f"path: no config.json in {str(p)!r}")
        return cls.from_dict(json.loads((p / "config.json").read_text()), name=p.name)

    @classmethod
    def from_dict(cls, d: dict, name: str = "checkpoint") -> "ModelConfig":
        """A config.json dict, in transformers' or DeepSeek's published fields (notes section 2)."""
        if not isinstance(d, dict):
            raise TypeError(f"d: expected a dict (config.json), got {type(d).__name__}")
        model_type = d.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ValueError(f"model_type: expected 'deepseek_v4', got {model_type!r}")
        n = int(d.get("num_hidden_layers", 43))
        head_dim = int(d.get("head_dim", 512))
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {d['hidden_act']!r}")
        rates = dict(_LAYER_TYPE_RATIO_KEY)
        rates.update(d.get("compress_rates") or {})
        if "compress_rate_csa" in d:
            rates["compressed_sparse_attention"] = d["compress_rate_csa"]
        if "compress_rate_hca" in d:
            rates["heavily_compressed_attention"] = d["compress_rate_hca"]
        types = d.get("layer_types")
        if types is None and d.get("compress_ratios") is not None:
            legacy = d["compress_ratios"]
            unknown = [r for r in legacy if r not in _LEGACY_RATIO_TYPE]
            if unknown:
                raise ValueError(f"compress_ratios: entries must be 0, 4 or 128, got {unknown}")
            types = [_LEGACY_RATIO_TYPE[r] for r in legacy]
        if types is None:  # transformers' default (HCA, HCA, HCA, CSA, ...: not the spec's V4-Pro parity)
            types = ["heavily_compressed_attention"] * min(n, 2) + [
                "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))
            ]
        types = list(types)[:n]
        ratios = []
        for t in types:
            if t == "sliding_attention":
                ratios.append(0)
            elif t in rates:
                ratios.append(int(rates[t]))
            else:
                raise ValueError(f"layer_types: unknown layer type {t!r}")
        mlp = d.get("mlp_layer_types")
        if mlp is None:
            n_hash = int(d.get("num_hash_layers", 3))
            mlp = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        prf = d.get("partial_rotary_factor")
        if prf is None:
            prf = d["qk_rope_head_dim"] / head_dim if d.get("qk_rope_head_dim") is not None else 64 / head_dim
        rope_dim = int(head_dim * prf)
        main, compress = _rope_configs(d)
        return cls(
            name=name,
            vocab_size=int(d.get("vocab_size", 129280)),
            hidden_size=int(d.get("hidden_size", 4096)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", d.get("intermediate_size", 2048))),
            num_hidden_layers=n,
            num_attention_heads=int(d.get("num_attention_heads", 64)),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=int(d.get("q_lora_rank", 1024)),
            o_groups=int(d.get("o_groups", 8)),
            o_lora_rank=int(d.get("o_lora_rank", 1024)),
            compress_ratios=tuple(ratios),
            mlp_layer_types=tuple(list(mlp)[:n]),
            sliding_window=int(d.get("sliding_window", 128)),
            index_n_heads=int(d.get("index_n_heads", 64)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            index_topk=int(d.get("index_topk", 512)),
            n_routed_experts=int(d.get("n_routed_experts", d.get("num_local_experts", 256))),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 6)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_main=main,
            rope_compress=compress,
            max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=int(d.get("bos_token_id", 0) or 0),
            eos_token_id=int(_first(d.get("eos_token_id", 1))),
        )


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def _rope_spec(p: dict, theta: float) -> RopeConfig:
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope_parameters: rope_type must be 'default' or 'yarn', got {rope_type!r}")
    theta = float(p.get("rope_theta", theta))
    if rope_type == "default":
        return RopeConfig("default", theta)
    return RopeConfig(
        "yarn",
        theta,
        None if p.get("factor") is None else float(p["factor"]),
        int(p["original_max_position_embeddings"]),
        float(p.get("beta_fast") or 32.0),
        float(p.get("beta_slow") or 1.0),
        float(p.get("attention_factor", 1.0)),
    )


def _rope_configs(d: dict) -> tuple[RopeConfig, RopeConfig]:
    """transformers' split of the RoPE parameters into "main" (SWA) and "compress" (CSA/HCA)."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(d.get("rope_theta", 10000.0))
    ctheta = float(d.get("compress_rope_theta", 160000.0))
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return _rope_spec(rp["main"], theta), _rope_spec(rp["compress"], ctheta)
    yarn = {k: v for k, v in rp.items() if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")}
    return RopeConfig("default", theta), _rope_spec(yarn, ctheta)


def _interleaved(first: tuple[int, ...], n: int) -> tuple[int, ...]:
    return first + tuple(4 if i % 2 == 0 else 128 for i in range(len(first), n))


PRESETS = {
    "tiny": ModelConfig(  # = dsv4_torch.hf.tiny_checkpoint.tiny_config()
        name="tiny", vocab_size=512, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=8, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        compress_ratios=(0, 0, 4, 128, 4, 128), mlp_layer_types=("hash_moe",) * 3 + ("moe",) * 3,
        sliding_window=8, index_n_heads=16, index_topk=8, n_routed_experts=8, num_experts_per_tok=2,
    ),  # fmt: skip
    "v4-flash": ModelConfig(),
    "v4-pro": ModelConfig(  # index_topk 1024 as in the project spec (section 1)
        name="V4-Pro", hidden_size=7168, moe_intermediate_size=3072, num_hidden_layers=61,
        num_attention_heads=128, q_lora_rank=1536, o_groups=16, compress_ratios=_interleaved((128, 128), 61),
        mlp_layer_types=("hash_moe",) * 3 + ("moe",) * 58, index_topk=1024, n_routed_experts=384,
        routed_scaling_factor=2.5,
    ),  # fmt: skip
}

# ----------------------------------------------------------------------------- small pieces


def linear(x, w):
    """x (..., in) @ w (out, in).T in x's dtype, float32 accumulation (torch's F.linear)."""
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), precision=HIGHEST, preferred_element_type=F32)
    return y.astype(x.dtype)


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


def init_cache(cfg: ModelConfig, num_slots: int, max_model_len: int, dtype) -> list[dict]:
    """Zeroed per-layer caches for `num_slots` requests of up to `max_model_len` tokens."""
    D, W = cfg.head_dim, cfg.sliding_window
    caches = []
    for r in cfg.compress_ratios:
        kind = layer_kind(r)
        c = {"window": jnp.zeros((num_slots, max(W - 1, 1), D), dtype)}
        if kind is not LayerKind.SWA:
            overlap = kind is LayerKind.CSA
            width = (2 if overlap else 1) * D
            ring = (2 if overlap else 1) * r
            c["entries"] = jnp.zeros((num_slots, -(-max_model_len // r), D), dtype)
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


def _compress(p, x, entries, ring_kv, ring_gate, step: StepInputs, cfg: ModelConfig, ratio: int, overlap: bool):
    """One compressor (section 8): emit this step's completed entries, update the ring.

    p: wkv, wgate (C, hidden), ape (ratio, C), norm (d,), with C = 2d (overlap) or d.
    entries (S, cap, d): entry w of slot s at [s, w]. ring_kv, ring_gate (S, ring, C): the
    projected kv / gate (no position bias) of position q at row q % ring.
    """
    S, ring = ring_kv.shape[:2]
    d = entries.shape[-1]
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
        dst = jnp.where(e < total, step.slot[owner], S)
        return entries.at[dst, w].set(entry.astype(entries.dtype), mode="drop")

    entries = lax.cond(total > 0, emit, lambda e: e, entries)
    b = step.token_request
    keep = step.token_valid & (step.positions >= step.seq_len[b] - ring)
    dst = jnp.where(keep, step.slot[b], S)
    ring_kv = ring_kv.at[dst, step.positions % ring].set(kv.astype(ring_kv.dtype), mode="drop")
    ring_gate = ring_gate.at[dst, step.positions % ring].set(gate.astype(ring_gate.dtype), mode="drop")
    return entries, ring_kv, ring_gate


def _index_topk(p, x, q_residual, entries, step: StepInputs, cfg: ModelConfig):
    """Lightning Indexer scores and top-k (section 9): (T, index_topk) int32 entry ids, -1 = none.

    Scores each token against the first `step.index_entries` entries of its request; row t holds
    its top min(visible, topk) visible entries first (visible = (p+1)//4).
    """
    T = x.shape[0]
    S = entries.shape[0]
    nh, dh = cfg.index_n_heads, cfg.index_head_dim
    N = step.index_entries
    cos, sin = rope_cos_sin(step.positions, cfg.rope_compress, cfg.rope_head_dim)
    q = apply_rope(linear(q_residual, p["wq_b"]).reshape(T, nh, dh), cos[:, None], sin[:, None]).astype(F32)
    head_w = linear(x, p["weights_proj"]).astype(F32) * nh**-0.5  # (T, nh)
    slot = jnp.minimum(step.slot[step.token_request], S - 1)
    visible = (step.positions + 1) // 4
    k = min(cfg.index_topk, N)
    # Token tiles bound the gathered keys to tile * N * dh elements.
    tile = T
    while tile > 8 and tile % 2 == 0 and tile * N * dh > (1 << 23):
        tile //= 2
    cols = jnp.arange(N, dtype=jnp.int32)

    def score_tile(args):
        q_t, w_t, slot_t, vis_t = args
        keys = entries[slot_t[:, None], cols[None, :]].astype(F32)  # (tile, N, dh)
        s = jax.nn.relu(jnp.einsum("thd,tnd->thn", q_t, keys, precision=HIGHEST)) * dh**-0.5
        score = (s * w_t[:, :, None]).sum(axis=1)
        score = jnp.where(cols[None, :] < vis_t[:, None], score, -jnp.inf)
        ids = lax.top_k(score, k)[1].astype(jnp.int32)
        return jnp.where(ids < vis_t[:, None], ids, -1)

    args = (q, head_w, slot, visible)
    ids = lax.map(score_tile, jax.tree.map(lambda a: a.reshape(T // tile, tile, *a.shape[1:]), args))
    ids = ids.reshape(T, k)
    if k < cfg.index_topk:
        ids = jnp.pad(ids, ((0, 0), (0, cfg.index_topk - k)), constant_values=-1)
    return ids


# ----------------------------------------------------------------------------- attention (section 7)


def _attend(q, meta, raw, comp, sink, topk, *, sm_scale, backend, mesh, axis):
    """`prefill_attention` for one layer; with a mesh, query heads are split over `axis`.

    The split is `dsv4_jax.sharding.sparse_attention_head_sharded`'s (q, sink and the output by
    head; workspace sources, metadata and top-k replicated), one level up: each device runs the
    whole chunk loop (gathers, indices) for its heads. No communication inside; the check of
    replicated values is off because it cannot see through pallas_call.
    """
    kw = dict(sm_scale=sm_scale, backend=backend)
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
    raw, cache["window"] = _window_step(cache["window"], kv, step)
    comp = topk = None
    if kind is not LayerKind.SWA:
        r = kind.ratio
        overlap = kind is LayerKind.CSA
        cache["entries"], cache["ring_kv"], cache["ring_gate"] = _compress(
            p["compressor"], x, cache["entries"], cache["ring_kv"], cache["ring_gate"], step, cfg, r, overlap
        )
        cap = cache["entries"].shape[1]
        comp = LogicalKV(cache["entries"].reshape(-1, D), (step.slot * cap).astype(jnp.int32))
    if kind is LayerKind.CSA:
        ip = p["indexer"]
        cache["index_entries"], cache["index_ring_kv"], cache["index_ring_gate"] = _compress(
            ip, x, cache["index_entries"], cache["index_ring_kv"], cache["index_ring_gate"], step, cfg, 4, True
        )
        topk = _index_topk(ip, x, q_residual, cache["index_entries"], step, cfg)

    out = _attend(q, meta, raw, comp, p["sink"].astype(F32), topk, sm_scale=D**-0.5, **opts)
    out = apply_rope(out, cos[:, None], -sin[:, None])  # undo V's RoPE at the query position
    grouped = out.reshape(T, cfg.o_groups, H * D // cfg.o_groups)
    y = jnp.einsum("tgi,goi->tgo", grouped, p["wo_a"].astype(out.dtype), precision=HIGHEST, preferred_element_type=F32)
    return linear(y.astype(x.dtype).reshape(T, -1), p["wo_b"]), cache


# ----------------------------------------------------------------------------- MoE (section 11)


def _score(logits, func: str):
    if func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if func == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softplus(logits)


def _swiglu(gate, up, limit):
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def moe(p, x, hash_experts, use_hash, cfg: ModelConfig):
    """Routed experts + the shared expert: x (T, hidden) -> (T, hidden).

    Hash layers (use_hash true) take their experts from hash_experts (T, k) = tid2eid[token_ids];
    the others route by top-k of score + bias. A traced flag, so both kinds share one program.
    """
    E, k, limit = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.swiglu_limit
    scores = _score(linear(x, p["gate"]), cfg.scoring_func)
    top = lax.top_k(scores.astype(F32) + p["bias"].astype(F32), k)[1]
    experts = jnp.where(use_hash, hash_experts, top)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor

    # Sort the (token, expert) pairs by expert: two grouped matmuls over contiguous groups.
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    h = lax.ragged_dot(x[token], p["w13"].astype(x.dtype), sizes, precision=HIGHEST, preferred_element_type=F32)
    inter = h.shape[-1] // 2
    act = _swiglu(h[:, :inter], h[:, inter:], limit).astype(x.dtype)
    out = lax.ragged_dot(act, p["w2"].astype(x.dtype), sizes, precision=HIGHEST, preferred_element_type=F32)
    out = out.astype(x.dtype) * weights.reshape(-1)[order][:, None].astype(x.dtype)
    routed = jnp.zeros_like(x).at[token].add(out)

    shared = _swiglu(linear(x, p["shared_w1"]), linear(x, p["shared_w3"]), limit)
    return routed + linear(shared, p["shared_w2"])


# ----------------------------------------------------------------------------- jitted pieces


@functools.partial(jax.jit, static_argnames=("cfg", "kind", "opts"), donate_argnames=("cache",))
def _layer(p, cache, X, step, meta, hash_experts, use_hash, *, cfg: ModelConfig, kind: LayerKind, opts):
    """One decoder layer (section 4): X (T, n, hidden) -> X, cache."""
    COMPILES[f"layer[{kind.name}]"] += 1
    post, comb, x = hyper_pre(p["attn_hc"], X, cfg)
    y, cache = attention(p["attn"], cache, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), step, meta, cfg, kind, dict(opts))
    X = hyper_post(X, y, post, comb)
    post, comb, x = hyper_pre(p["ffn_hc"], X, cfg)
    y = moe(p["ffn"], rms_norm(x, p["ffn_norm"], cfg.rms_norm_eps), hash_experts, use_hash, cfg)
    return hyper_post(X, y, post, comb), cache


@jax.jit
def _hash_route(tid2eid, token_ids):
    return tid2eid[token_ids]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(embed, token_ids, *, cfg: ModelConfig):
    COMPILES["embed"] += 1
    x = embed[token_ids]
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], cfg.hc_mult, x.shape[1]))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _head(p, X, rows, *, cfg: ModelConfig):
    """Logits (R, vocab) float32 of token rows `rows`, and their greedy next tokens (R,)."""
    COMPILES["head"] += 1
    h = rms_norm(hyper_head(p["hc_head"], X[rows], cfg), p["norm"], cfg.rms_norm_eps)
    logits = linear(h, p["head"]).astype(F32)
    return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def compile_counts() -> dict[str, int]:
    """Traces (each one a compilation) of the model's jitted functions so far, by name."""
    return dict(COMPILES)


# ----------------------------------------------------------------------------- the model


@dataclass
class StepOutput:
    """What one step returns. logits: (R, vocab) float32 device array, rows = `rows` of the
    step (all tokens, request-major, or each request's last token); next_tokens: (R,) argmax.
    query_lens: the real tokens of each request. plan: the host `planner.StepPlan`."""

    logits: jax.Array
    next_tokens: jax.Array
    all_tokens: bool
    query_lens: list[int]
    plan: object

    def request_logits(self) -> list[np.ndarray]:
        """Per request: (query_len, vocab) if all_tokens else (vocab,), as NumPy."""
        logits = np.asarray(self.logits)
        if not self.all_tokens:
            return [logits[b] for b in range(len(self.query_lens))]
        starts = np.concatenate([[0], np.cumsum(self.query_lens)])
        return [logits[a:b] for a, b in zip(starts[:-1], starts[1:])]


class DeepseekV4:
    """A DeepSeek-V4 model with per-request caches, run one ragged step at a time.

    Args:
      config: `ModelConfig`. params: the tree of `dsv4_jax.checkpoint.load_params`.
      max_batch_size: cache slots (requests in flight). max_model_len: tokens per request.
      max_num_batched_tokens: most new tokens of one request in one step (planner limit).
      attention_backend: "auto", "xla" or "pallas" (see `dsv4_jax.sparse_attention`).
      planner: "adaptive", "fixed" or "per_request" (`planner.PlanConfig.policy`).
      mesh, axis: optional; split attention heads over mesh axis `axis` (simulated or real devices).
      min_tokens, min_workspace_rows, min_requests: the smallest token / workspace / request
        buckets (fewer compiles; requests are padded to a power of two, at most max_batch_size's).
      token_buckets: "fine" (`dsv4_jax.buckets.bucket`: pads tokens at most 1.25x) or "pow2" (at
        most 2x, but about 4x fewer token shapes, so fewer compilations for varied batches).
      token_tile, gather_tile: the largest attention / gather tiles of `build_step_metadata`
        (smaller ladders compile faster; the defaults suit long prefills).
    """

    def __init__(self, config: ModelConfig, params: dict, *, max_batch_size: int = 8, max_model_len: int = 4096,
                 max_num_batched_tokens: int = 512, attention_backend: str = "auto", planner: str = "adaptive",
                 mesh: Mesh | None = None, axis: str | None = None, min_tokens: int = 16,
                 min_workspace_rows: int = 128, token_tile: int = 256, gather_tile: int = 4096,
                 min_requests: int = 8, token_buckets: str = "fine"):  # fmt: skip
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        for name, v in (("max_batch_size", max_batch_size), ("max_model_len", max_model_len),
                        ("max_num_batched_tokens", max_num_batched_tokens)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if planner not in ("adaptive", "fixed", "per_request"):
            raise ValueError(f"planner: expected 'adaptive', 'fixed' or 'per_request', got {planner!r}")
        if not isinstance(params, dict) or len(params.get("layers", ())) != config.num_hidden_layers:
            raise ValueError(f"params: expected the tree of dsv4_jax.checkpoint.load_params for {config.num_hidden_layers} layers")
        if attention_backend not in ("auto", "xla", "pallas", "pallas_triton", "pallas_interpret"):
            raise ValueError(f"attention_backend: expected 'auto', 'xla' or 'pallas', got {attention_backend!r}")
        if mesh is not None:
            if not isinstance(mesh, Mesh):
                raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
            axis = axis or mesh.axis_names[0]
            if axis not in mesh.axis_names:
                raise ValueError(f"axis: {axis!r} is not an axis of the mesh {mesh.axis_names}")
            if config.num_attention_heads % mesh.shape[axis]:
                raise ValueError(f"mesh: {config.num_attention_heads} heads do not split over {mesh.shape[axis]} devices")
        # With a mesh every input lives replicated on it, so each layer program sees one input
        # sharding (else outputs of one call, placed by XLA, would retrace the next).
        self._placement = None if mesh is None else NamedSharding(mesh, P())
        self.config = config
        self.params = params if mesh is None else jax.device_put(params, self._placement)
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.dtype = params["embed"].dtype
        self.plan_config = PlanConfig(
            window_size=config.sliding_window,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=planner,
        )
        self._min_requests = min(_pow2(min_requests), _pow2(max_batch_size))
        if token_buckets not in ("fine", "pow2"):
            raise ValueError(f"token_buckets: expected 'fine' or 'pow2', got {token_buckets!r}")
        self._token_buckets = token_buckets
        self._min_tokens = min_tokens
        self._min_workspace_rows = min_workspace_rows
        self._bucket_options = dict(token_tile=token_tile, gather_tile=gather_tile)
        self._opts = (("backend", attention_backend), ("mesh", mesh), ("axis", axis))
        # Hash layers keep their tid2eid table out of the layer parameters (a zero bias stands
        # in), so hash and top-k layers of a kind have one parameter structure and one program.
        self._layer_params, self._hash_tables = [], []
        for lp in self.params["layers"]:
            ffn = dict(lp["ffn"])
            table = ffn.pop("tid2eid", None)
            ffn.setdefault("bias", jax.device_put(jnp.zeros((config.n_routed_experts,), F32), self._placement))
            self._layer_params.append({**lp, "ffn": ffn})
            self._hash_tables.append(table)

    @classmethod
    def from_checkpoint(cls, path, dtype="float32", **kwargs) -> "DeepseekV4":
        from dsv4_jax.checkpoint import load_checkpoint

        config, params = load_checkpoint(path, dtype=dtype)
        return cls(config, params, **kwargs)

    def init_cache(self) -> list[dict]:
        cache = init_cache(self.config, self.max_batch_size, self.max_model_len, self.dtype)
        return cache if self._placement is None else jax.device_put(cache, self._placement)

    def prepare_step(self, slots: Sequence[int], prefix_lens: Sequence[int], tokens: Sequence[Sequence[int]],
                     all_tokens: bool = False):  # fmt: skip
        """Host side of a step: plan attention, pad and copy the step's arrays.

        slots[b], prefix_lens[b]: request b's cache slot and tokens already in it; tokens[b]: its
        new tokens (>= 1). Returns (StepInputs, logit rows (R,) int32 = the token rows whose logits
        the head computes, {LayerKind: KindMetadata}, the step's `planner.StepPlan`). The rows are kept out of
        StepInputs: their count (all tokens or one per request) is no business of the layers.
        """
        B = len(slots)
        if B == 0 or len(prefix_lens) != B or len(tokens) != B:
            raise ValueError(f"slots, prefix_lens, tokens: need the same non-zero length, got {B}, {len(prefix_lens)}, {len(tokens)}")
        slots = [int(s) for s in slots]
        if len(set(slots)) != B or min(slots) < 0 or max(slots) >= self.max_batch_size:
            raise ValueError(f"slots: need distinct slots in 0..{self.max_batch_size - 1}, got {slots}")
        q_lens = np.array([len(t) for t in tokens], dtype=np.int64)
        if q_lens.min() < 1:
            raise ValueError(f"tokens: every request needs >= 1 new token, got lengths {q_lens.tolist()}")
        prefix = np.array([int(p) for p in prefix_lens], dtype=np.int64)
        if prefix.min() < 0:
            raise ValueError(f"prefix_lens: must be >= 0, got {prefix.tolist()}")
        seq = prefix + q_lens
        ids = np.concatenate([np.asarray(t, dtype=np.int64).reshape(-1) for t in tokens])
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"tokens: ids must be in 0..{self.config.vocab_size - 1}, got {int(ids.min())}..{int(ids.max())}")
        batch = PrefillBatch(seq, q_lens, self.max_model_len, self.plan_config.max_num_batched_tokens)
        plan = plan_step(batch, self.plan_config, self.config.compress_ratios)  # once per step
        # Per kind, the workspace is padded to a power of two: its size is a compile key but costs
        # only its allocation (gathers and attention cover the real rows), so coarse buckets are
        # cheap here, unlike the token buckets, which pad compute.
        meta = {}
        min_tokens = self._min_tokens if self._token_buckets == "fine" else _pow2(batch.num_tokens, self._min_tokens)
        for kind, kp in plan.kinds.items():
            rows = max(self._min_workspace_rows, _pow2(kp.max_workspace_rows))
            one = StepPlan(batch=batch, config=self.plan_config, kinds={kind: kp})
            m = build_step_metadata(
                one, index_topk=self.config.index_topk, device=self._placement, min_workspace_rows=rows,
                min_tokens=min_tokens, **self._bucket_options,
            )  # fmt: skip
            meta[kind] = m[kind]
        T, T_pad, B_pad = int(q_lens.sum()), m.padded_tokens, _pow2(B, self._min_requests)
        S = self.max_batch_size

        def pad(a, n, fill):
            out = np.full(n, fill, dtype=np.int32)
            out[: len(a)] = a
            return out

        token_request = np.repeat(np.arange(B), q_lens)
        positions = batch.token_position
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        if all_tokens:
            rows = np.arange(T_pad)
        else:
            rows = pad(starts + q_lens - 1, B_pad, 0)
        max_entries = int(seq.max()) // 4
        index_entries = min(_pow2(max_entries, 128), -(-self.max_model_len // 4))
        step = StepInputs(
            token_ids=pad(ids, T_pad, 0),
            positions=pad(positions, T_pad, 0),
            token_request=pad(token_request, T_pad, 0),
            token_valid=pad(np.ones(T), T_pad, 0).astype(bool),
            slot=pad(slots, B_pad, S),
            prefix=pad(prefix, B_pad, 0),
            seq_len=pad(seq, B_pad, 0),
            token_start=pad(starts, B_pad, T),
            index_entries=index_entries,
        )
        step, rows = jax.device_put((step, rows.astype(np.int32)), self._placement)
        return step, rows, meta, plan

    def step(self, cache: list[dict], slots, prefix_lens, tokens, all_tokens: bool = False):
        """Run one ragged step; returns (new cache, StepOutput). The old cache may be donated."""
        step, rows, meta, plan = self.prepare_step(slots, prefix_lens, tokens, all_tokens)
        cfg = self.config
        X = _embed(self.params["embed"], step.token_ids, cfg=cfg)
        cache = list(cache)
        no_route = jax.device_put(np.zeros((X.shape[0], cfg.num_experts_per_tok), np.int32), self._placement)
        flags = [jax.device_put(np.bool_(t is not None), self._placement) for t in self._hash_tables]
        for i, (kind, lp) in enumerate(zip(cfg.kinds, self._layer_params)):
            table = self._hash_tables[i]
            route = no_route if table is None else _hash_route(table, step.token_ids)
            X, cache[i] = _layer(
                lp, cache[i], X, step, meta[kind], route, flags[i], cfg=cfg, kind=kind, opts=self._opts
            )
        head = {k: self.params[k] for k in ("hc_head", "norm", "head")}
        logits, next_tokens = _head(head, X, rows, cfg=cfg)
        q_lens = [len(t) for t in tokens]
        return cache, StepOutput(logits, next_tokens, all_tokens, q_lens, plan)


def _pow2(n: int, minimum: int = 1) -> int:
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()
