"""The contract in one place: layer kinds, names, FlashMLA constants, per-request formulas, presets.

Everything both framework packages and the planner agree on lives here (spec sections 1-4), so a
fact has one home:

* `LayerKind`: what a layer attends to (SWA / CSA / HCA). A kind is *not* a ratio: a layer is a
  kind plus its own compress ratio (`LayerSpec`), any integer >= 1 for a compressed kind.
  `layer_specs` reads a model config (transformers' `layer_types` + `compress_rates`, or
  DeepSeek's per-layer `compress_ratios`).
* `POLICIES`, `ORDERS`, `SIZES`: the planning choices. (Each framework's kernels are its own
  table: `dsv4_torch.backends`, `dsv4_jax.backends`.)
* FlashMLA's kernel constants (`D_V`, `INDEX_ALIGN`, `FLASHMLA_HEADS`, `FLASHMLA_HEAD_DIMS`).
* The per-request formulas (`has_compressed`, `compressed_len`, `gather_len`,
  `max_compressed_len`, `compressed_index_width`, `index_width_for`): vectorized, for ints and NumPy arrays alike.
* `PRESETS`: V4-Flash, V4-Pro and the tiny test model as config.json dicts (transformers' field
  names). The planner's `ModelShape`, the JAX `ModelConfig` presets and the tiny checkpoint
  writer all derive from this one table.
* `BackendUnavailableError`: raised by both frameworks when a named backend cannot run
  (`backend_unavailable(name, reason)` words it).
"""

from __future__ import annotations

import copy
import enum
from collections import Counter
from dataclasses import dataclass

import numpy as np

from planner.checks import INT32_MAX, as_int

# ----------------------------------------------------------------------------- kinds


class LayerKind(enum.Enum):
    """Attention layer kinds, named by what the compressed part of a query's key set holds."""

    SWA = "SWA"  # sliding window only: no compressed part
    CSA = "CSA"  # the Lightning Indexer's top-k of the compressed entries ("c4a" in V4.0)
    HCA = "HCA"  # every visible compressed entry, dense ("c128a" in V4.0)

    @property
    def has_compressed(self) -> bool:
        """Whether layers of this kind gather a compressed cache."""
        return self is not LayerKind.SWA

    @property
    def layer_type(self) -> str:
        """transformers' name of the kind (`config.layer_types` entries)."""
        return _LAYER_TYPE_OF_KIND[self]

    @classmethod
    def of(cls, kind) -> LayerKind:
        """A `LayerKind` from itself, its name ("CSA", any case) or transformers' layer type."""
        if isinstance(kind, LayerKind):
            return kind
        if isinstance(kind, str):
            key = kind.strip()
            if key.upper() in cls.__members__:
                return cls[key.upper()]
            if key in _KIND_OF_LAYER_TYPE:
                return _KIND_OF_LAYER_TYPE[key]
        raise ValueError(
            f"kind: expected a LayerKind, one of {[k.name for k in cls]} or a layer type "
            f"{sorted(_KIND_OF_LAYER_TYPE)}, got {kind!r}"
        )


_LAYER_TYPE_OF_KIND = {
    LayerKind.SWA: "sliding_attention",
    LayerKind.CSA: "compressed_sparse_attention",
    LayerKind.HCA: "heavily_compressed_attention",
}
_KIND_OF_LAYER_TYPE = {v: k for k, v in _LAYER_TYPE_OF_KIND.items()}
LAYER_TYPES = tuple(_LAYER_TYPE_OF_KIND.values())

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")  # the official composite, transformers' text config
V41_FIELDS = ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id")


def is_v41_config(config) -> bool:
    """Whether a config.json dict is DeepSeek-V4.1's (its model type, or a V4.1-only field)."""
    if not isinstance(config, dict):
        return False
    text = config.get("text_config")
    return (
        config.get("model_type") in V41_MODEL_TYPES
        or (
            isinstance(text, dict) and (text.get("model_type") in V41_MODEL_TYPES or any(k in text for k in V41_FIELDS))
        )
        or any(k in config for k in V41_FIELDS)
    )


# DeepSeek-V4.0's ratios per kind, what its published `compress_ratios` lists mean.
V4_RATIOS = {LayerKind.SWA: 0, LayerKind.CSA: 4, LayerKind.HCA: 128}
_V4_KIND_OF_RATIO = {0: LayerKind.SWA, 4: LayerKind.CSA, 128: LayerKind.HCA}


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's kind and compress ratio (what a plan depends on).

    SWA layers have no compressed part (their ratio is 0 in V4.0 configs and is ignored); CSA and
    HCA layers take any ratio >= 1. Layers with equal specs share one plan per step.
    """

    kind: LayerKind
    compress_ratio: int

    def __post_init__(self):
        kind = LayerKind.of(self.kind)
        r = as_int(self.compress_ratio, "compress_ratio", minimum=0, maximum=INT32_MAX)
        if kind.has_compressed and r < 1:
            raise ValueError(f"compress_ratio: {kind.name} layers need a ratio >= 1, got {r}")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "compress_ratio", 0 if kind is LayerKind.SWA else r)

    @property
    def has_compressed(self) -> bool:
        return self.kind.has_compressed

    @classmethod
    def of(cls, spec) -> LayerSpec:
        """A `LayerSpec` from itself or a `(kind, compress_ratio)` pair."""
        if isinstance(spec, LayerSpec):
            return spec
        if isinstance(spec, tuple) and len(spec) == 2:
            return cls(LayerKind.of(spec[0]), spec[1])
        raise ValueError(f"layers: expected LayerSpec or (kind, compress_ratio) entries, got {spec!r}")


# Kinds and V4.0 ratios: what a plan covers when the caller names no model.
V4_LAYERS = tuple(LayerSpec(k, r) for k, r in V4_RATIOS.items())

# The rows a layer computes in a prefill step (DeepSeek-V4.1's decoder bounded replay, vLLM's
# `swa_bounded_replay`; `planner.schedule` says which layer takes which band):
#   "full":   every new row, windows reaching back W - 1 positions (down to a request's
#             `replay_start`, where a prefix hit's window KV begins);
#   "cut":    the last KV source under replay: each request's last min(query_len, W) rows, with
#             the full band's windows (it wrote every row's window KV first);
#   "replay": layers past the cut: the same rows, windows clamped to them for a trimmed request.
BANDS = ("full", "cut", "replay")


@dataclass(frozen=True)
class PlanKey:
    """What a plan depends on besides the batch: the layer spec and the band of rows it computes.

    Layers with equal keys share one plan per step. `band` is one of `BANDS`.
    """

    layer: LayerSpec
    band: str = "full"

    def __post_init__(self):
        object.__setattr__(self, "layer", LayerSpec.of(self.layer))
        if self.band not in BANDS:
            raise ValueError(f"band: expected one of {BANDS}, got {self.band!r}")

    @property
    def kind(self) -> LayerKind:
        return self.layer.kind

    @property
    def compress_ratio(self) -> int:
        return self.layer.compress_ratio

    @property
    def has_compressed(self) -> bool:
        return self.layer.has_compressed

    def __str__(self):
        return f"{self.kind.name}{self.compress_ratio if self.has_compressed else ''}/{self.band}"


def as_layer_specs(layers) -> tuple[LayerSpec, ...]:
    """The distinct layer specs of `layers`, one per kind, in first-seen order.

    layers: a `{kind: compress_ratio}` mapping, or an iterable of `LayerSpec` / `(kind, ratio)`
      entries (a model's per-layer list is fine: repeats collapse). One ratio per kind: a model
      whose layers of one kind used two ratios would need two plans under one name.
    """
    if isinstance(layers, dict):
        entries = list(layers.items())
    elif isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise ValueError(f"layers: expected a {{kind: compress_ratio}} mapping or (kind, ratio) pairs, got {layers!r}")
    else:
        entries = list(layers)
    out: dict[LayerKind, LayerSpec] = {}
    for e in entries:
        if isinstance(e, (int, np.integer)) and not isinstance(e, bool):
            raise ValueError(
                f"layers: got the bare ratio {int(e)}; a ratio does not say the kind. Pass LayerSpec(kind, ratio) "
                "entries, (kind, ratio) pairs or {kind: ratio} (planner.V4_LAYERS; planner.layer_specs(config) "
                "reads a model config)"
            )
        spec = LayerSpec.of(e)
        seen = out.get(spec.kind)
        if seen is not None and seen != spec:
            raise ValueError(
                f"layers: {spec.kind.name} layers with two ratios ({seen.compress_ratio} and {spec.compress_ratio})"
            )
        out[spec.kind] = spec
    return tuple(out.values())


def layer_specs(config: dict) -> tuple[LayerSpec, ...]:
    """Every decoder layer's `LayerSpec` from a config.json dict (no MTP layer).

    transformers' fields: `layer_types` (kinds) and `compress_rates` (ratio per kind, default
    V4.0's 4 / 128; `compress_rate_csa` / `compress_rate_hca` fold in). DeepSeek's published
    fields: per-layer `compress_ratios` (0 / 4 / 128, V4.0's meaning; the trailing MTP entries are
    dropped), used only when `layer_types` is absent.

    A DeepSeek-V4.1 config (`is_v41_config`) is refused: its layers are a `planner.Schedule`
    (`Schedule.from_config(config)`, whose `layer_specs` are these specs and whose roles say which
    plan each layer reads).
    """
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a config.json dict, got {type(config).__name__}")
    if is_v41_config(config):
        raise ValueError(
            "config: a DeepSeek-V4.1 config (model_type or kv/index source fields); its layers are a "
            "planner.Schedule: Schedule.from_config(config)"
        )
    n = config.get("num_hidden_layers")
    rates = {
        "compressed_sparse_attention": V4_RATIOS[LayerKind.CSA],
        "heavily_compressed_attention": V4_RATIOS[LayerKind.HCA],
    }
    rates.update(config.get("compress_rates") or {})
    if config.get("compress_rate_csa") is not None:
        rates["compressed_sparse_attention"] = config["compress_rate_csa"]
    if config.get("compress_rate_hca") is not None:
        rates["heavily_compressed_attention"] = config["compress_rate_hca"]
    types = config.get("layer_types")
    if types is not None:
        specs = []
        for i, t in enumerate(types):
            kind = LayerKind.of(t) if t in _KIND_OF_LAYER_TYPE else None
            if kind is None:
                raise ValueError(
                    f"config.layer_types[{i}]: unknown layer type {t!r} (expected one of {list(LAYER_TYPES)})"
                )
            r = 0 if kind is LayerKind.SWA else rates.get(kind.layer_type)
            try:
                specs.append(LayerSpec(kind, r))
            except ValueError as e:
                raise ValueError(f"config.compress_rates[{kind.layer_type!r}]: {e}") from None
    elif config.get("compress_ratios") is not None:
        specs = []
        for i, r in enumerate(config["compress_ratios"]):
            if r not in _V4_KIND_OF_RATIO:
                raise ValueError(
                    f"config.compress_ratios[{i}]: {r!r} has no kind in DeepSeek-V4.0's convention (0 SWA, 4 CSA, "
                    "128 HCA); give `layer_types` and `compress_rates` for other ratios"
                )
            specs.append(LayerSpec(_V4_KIND_OF_RATIO[r], r))
    else:
        raise ValueError(
            "config: needs `layer_types` (transformers) or `compress_ratios` (DeepSeek) to tell layer kinds"
        )
    if n is not None:
        specs = specs[: int(n)]
    return tuple(specs)


# ----------------------------------------------------------------------------- names

POLICIES = ("adaptive", "fixed", "per_request")  # `policy=`: the chunk plan
ORDERS = ("batch", "length")  # `order=`: how the planner scans requests
SIZES = ("bucket", "fine", "server")  # `sizes=`: how jitted prefill pads its static shapes


class BackendUnavailableError(RuntimeError):
    """A backend asked for by name cannot run here (the message says why)."""


def backend_unavailable(backend: str, reason: str) -> BackendUnavailableError:
    """The error for a named backend that cannot run: "backend='name' cannot run here: reason"."""
    return BackendUnavailableError(f"backend={backend!r} cannot run here: {reason}")


# ----------------------------------------------------------------------------- FlashMLA

D_V = 512  # FlashMLA's value dim: V is the first 512 dims of the gathered row
INDEX_ALIGN = 128  # FlashMLA on SM90 wants index rows in multiples of 128 columns (pad with -1)
FLASHMLA_HEADS = (64, 128)  # head counts its sparse prefill kernels take (pad others up)
FLASHMLA_HEAD_DIMS = (512, 576)  # q/k dims it takes


def value_dim(d_qk: int) -> int:
    """d_v for a key/query dim: 512 for FlashMLA's 512/576, the whole row for smaller test dims."""
    return min(int(d_qk), D_V)


def round_up(x, m: int):
    """The smallest multiple of `m` >= `x` (ints, or NumPy integer arrays elementwise)."""
    return -(-x // m) * m


def cdiv(a, b: int):
    """ceil(a / b) in integer math (ints, or NumPy / JAX integer arrays elementwise)."""
    return -(-a // b)


# ----------------------------------------------------------------------------- formulas


def has_compressed(compress_ratio: int, has_compressed: bool | None = None) -> bool:
    """vLLM 0.33's rule: an explicit flag wins; None means `compress_ratio > 1` (the V4.0 default).

    `has_compressed=True` with ratio 1 is DeepSeek-V4.1's full-length compressed cache.
    """
    r = as_int(compress_ratio, "compress_ratio", minimum=0, maximum=INT32_MAX)
    if has_compressed is None:
        return r > 1
    if not isinstance(has_compressed, (bool, np.bool_)):
        raise ValueError(f"has_compressed: expected True, False or None, got {has_compressed!r}")
    if has_compressed and r < 1:
        raise ValueError(f"compress_ratio: has_compressed=True needs a ratio >= 1, got {r}")
    return bool(has_compressed)


def compressed_len(seq_len, compress_ratio: int, has_compressed: bool = True):
    """Compressed rows a request gathers: `seq_len // r` (0 without a compressed cache)."""
    if not has_compressed:
        return seq_len * 0
    return seq_len // compress_ratio


def gather_len(seq_len, query_len, window_size: int, window_start=0):
    """Raw rows a request gathers: its new tokens plus up to W-1 tokens of history.

    window_start: the lowest position whose window KV the request holds (vLLM's `replay_start`
      after a prefix hit, or the replay band's clamp; 0: all of it); history below it is not
      gathered: `query_len + min(max(prefix - window_start, 0), W - 1)` (vLLM's
      `ComputePrefillMetadataKernel`, `v1/attention/backends/mla/sparse_swa.py`).
    """
    return query_len + np.minimum(np.maximum(seq_len - query_len - window_start, 0), window_size - 1)


def replay_start_of_hit(hit_tokens, window_size: int, block_size: int = 1):
    """Where a prefix-cache hit's bounded replay starts (DeepSeek-V4.1 in vLLM): `hit - W`, or 0.

    The hit is first rounded down to a multiple of `block_size` (vLLM rounds an external hit; a
    local hit is whole blocks already). A hit of at most W tokens is dropped (the request is
    computed from 0); a longer one recomputes its last W tokens, so the request's computed prefix
    after the rewind is this same value (`Scheduler._mark_prefix_replay`,
    `v1/core/sched/scheduler.py`). Ints or integer arrays.
    """
    hit = np.asarray(hit_tokens, dtype=np.int64)
    if hit.size and int(hit.min()) < 0:
        raise ValueError(f"hit_tokens: must be >= 0, got {hit_tokens!r}")
    w = as_int(window_size, "window_size", minimum=1)
    hit = hit - hit % as_int(block_size, "block_size", minimum=1)
    start = np.where(hit > w, hit - w, 0)
    return int(start) if start.ndim == 0 else start


def max_compressed_len(max_model_len: int, compress_ratio: int, has_compressed: bool = True) -> int:
    """vLLM's per-request bound of compressed rows: `cdiv(max_model_len, r)` (0 without)."""
    return cdiv(int(max_model_len), int(compress_ratio)) if has_compressed else 0


def visible_entries(position, compress_ratio: int):
    """Compressed entries visible to the query at absolute `position`: `(p + 1) // r`."""
    return (position + 1) // compress_ratio


def compressed_index_width(kind: LayerKind, max_seq_len: int, compress_ratio: int, topk: int | None = None) -> int:
    """Index columns of the compressed part: top-k (CSA), the most visible entries (HCA), 0 (SWA).

    HCA's is `max_seq_len // r`: no query of a request of `max_seq_len` tokens sees more.
    """
    kind = LayerKind.of(kind)
    if kind is LayerKind.SWA:
        return 0
    if kind is LayerKind.CSA:
        if topk is None:
            raise ValueError("topk: required for CSA layers")
        return int(topk)
    return int(max_seq_len) // int(compress_ratio)


def index_width_for(
    kind: LayerKind, max_seq_len: int, compress_ratio: int, window_size: int, topk: int | None = None
) -> int:
    """The index width for requests of up to `max_seq_len` tokens: compressed part + W, rounded up
    to `INDEX_ALIGN` (`planner.layout.index_width(plan)` is this for a plan's longest request)."""
    return round_up(compressed_index_width(kind, max_seq_len, compress_ratio, topk) + int(window_size), INDEX_ALIGN)


# ----------------------------------------------------------------------------- presets


def _v4_layer_types(first: tuple[LayerKind, ...], num_layers: int) -> list[str]:
    """`first` bootstrap layers, then CSA on even and HCA on odd layer indices."""
    kinds = list(first) + [LayerKind.CSA if i % 2 == 0 else LayerKind.HCA for i in range(len(first), num_layers)]
    return [k.layer_type for k in kinds]


def _rope(head_dim: int, rope_dim: int) -> dict:
    prf = rope_dim / head_dim
    return {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": prf},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": prf, "factor": 16.0,
                     "original_max_position_embeddings": 65536, "beta_fast": 32.0, "beta_slow": 1.0,
                     "attention_factor": 1.0},
    }  # fmt: skip


def _preset(**fields) -> dict:
    head_dim, rope_dim = 512, 64
    n = fields["num_hidden_layers"]
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": n,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": head_dim, "q_lora_rank": 1024,
        "partial_rotary_factor": rope_dim / head_dim, "o_groups": 8, "o_lora_rank": 1024,
        "layer_types": None, "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "rope_parameters": _rope(head_dim, rope_dim),
        "max_position_embeddings": 1048576, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * (n - 3), "n_routed_experts": 256, "num_experts_per_tok": 6,
        "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "hidden_act": "silu", "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    }  # fmt: skip
    cfg.update(fields)
    return cfg


# Config dicts in transformers' field names (config.json content), keyed by preset name.
PRESETS = {
    "V4-Flash": _preset(
        num_hidden_layers=43,
        layer_types=_v4_layer_types((LayerKind.SWA, LayerKind.SWA), 43),
    ),  # fmt: skip
    "V4-Pro": _preset(  # index_topk 1024 as in the spec (section 1)
        num_hidden_layers=61,
        layer_types=_v4_layer_types((LayerKind.HCA, LayerKind.HCA), 61),
        hidden_size=7168,
        moe_intermediate_size=3072,
        num_attention_heads=128,
        q_lora_rank=1536,
        o_groups=16,
        index_topk=1024,
        n_routed_experts=384,
        routed_scaling_factor=2.5,
    ),  # fmt: skip
    # Real head geometry (head_dim 512 with 64 RoPE dims, index_head_dim 128, hc_mult 4, Sinkhorn 20
    # iterations, YaRN on the compressed layers) at toy width; every kind at least twice, SWA first.
    # Small ratios would let short prompts reach more entries; 4 / 128 keep V4.0's convention.
    "tiny": _preset(
        num_hidden_layers=6,
        layer_types=[
            k.layer_type
            for k in (LayerKind.SWA, LayerKind.SWA, LayerKind.CSA, LayerKind.HCA, LayerKind.CSA, LayerKind.HCA)
        ],
        vocab_size=512,
        hidden_size=64,
        moe_intermediate_size=64,
        num_attention_heads=8,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=8,
        index_n_heads=16,
        index_topk=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3,
        pad_token_id=2,
        use_cache=True,
        dtype="float32",
    ),  # fmt: skip
}


def _v41_preset(**fields) -> dict:
    """A DeepSeek-V4.1 text config (transformers' `DeepseekV41TextConfig` fields, flat)."""
    head_dim, rope_dim = 512, 64
    cfg = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41_text",
        "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": head_dim, "qk_rope_head_dim": rope_dim, "q_lora_rank": 1280,
        "o_groups": 8, "o_lora_rank": 1024, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 65536},
        "max_position_embeddings": 1048576, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "moe_intermediate_size": 2304, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "hidden_act": "silu", "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14], "num_nextn_predict_layers": 3, "rms_norm_eps": 1e-20,
        "tie_word_embeddings": False, "eos_token_id": 1,
    }  # fmt: skip
    cfg.update(fields)
    return cfg


# DeepSeek-V4.1 (`planner.Schedule` reads their layer schedule). Not in `PRESETS`: that table's
# readers (`dsv4_jax.model.config.PRESETS`) take V4.0 configs only.
V41_PRESETS = {
    # The released DeepSeek-V4.1-Flash text model: transformers' DeepseekV41TextConfig defaults (its
    # docstring: the released checkpoint's config), widths as vLLM 0.32's V4.1 kernels hard-code
    # them (hidden 5120, q rank 1280, 64 heads, MoE 384 x 2304); 40 layers + 3 DSpark draft layers.
    "V4.1": _v41_preset(),
    # 7 layers of every role (v41-facts.md): window, ratio-2 source and reuse, the ratio-1 cut
    # (candidate source), a reuse, a reindex (candidate consumer) and its reuse; real head geometry
    # (head_dim 512, RoPE 64, index_head_dim 128, 16 indexer heads), toy widths; no Engram (it
    # needs the real tokenizer), no draft layers.
    "V4.1-tiny": _v41_preset(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=7,
        num_attention_heads=8,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=16,
        compress_ratios=[0, 2, 2, 1, 1, 1, 1],
        kv_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 3, 5],
        candidate_source_layer_id=3,
        candidate_topk_blocks=4,
        candidate_block_size=4,
        index_n_heads=16,
        index_topk=8,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        engram_layer_ids=[],
        num_nextn_predict_layers=0,
        rms_norm_eps=1e-6,
        pad_token_id=2,
        dtype="float32",
    ),
}


def _preset_name(name: str) -> str:
    key = str(name).lower().replace("_", "-")
    for k in (*PRESETS, *V41_PRESETS):
        if k.lower() == key:
            return k
    raise ValueError(f"name: expected one of {[*PRESETS, *V41_PRESETS]}, got {name!r}")


def preset(name: str) -> dict:
    """A copy of one preset's config dict (`PRESETS` or `V41_PRESETS`); `name` is matched without
    case ("v4_flash", "v4.1-tiny" work)."""
    k = _preset_name(name)
    return copy.deepcopy(PRESETS[k] if k in PRESETS else V41_PRESETS[k])


@dataclass(frozen=True)
class ModelShape:
    """What attention planning needs of a DeepSeek-V4.0 model: its layer specs (the MTP layer last)
    and shapes. (A V4.1 model's layers are a `planner.Schedule`.)"""

    name: str
    num_heads: int
    head_dim: int
    window_size: int
    index_topk: int
    layers: tuple[LayerSpec, ...]

    @classmethod
    def from_config(cls, config: dict, name: str = "checkpoint") -> ModelShape:
        specs = layer_specs(config) + (LayerSpec(LayerKind.SWA, 0),) * int(config.get("num_nextn_predict_layers", 0))
        ints = (int(config[k]) for k in ("num_attention_heads", "head_dim", "sliding_window", "index_topk"))
        return cls(name, *ints, specs)

    @classmethod
    def from_name(cls, name: str) -> ModelShape:
        return cls.from_config(preset(name), _preset_name(name))

    def layers_per_kind(self) -> dict[LayerKind, int]:
        counts = Counter(s.kind for s in self.layers)
        return {k: counts.get(k, 0) for k in LayerKind}

    @property
    def kind_specs(self) -> tuple[LayerSpec, ...]:
        """One spec per kind (what `plan_step` takes); `layers` has one per decoder layer."""
        return as_layer_specs(self.layers)
