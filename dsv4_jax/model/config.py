"""DeepSeek-V4 hyper-parameters for the JAX model: `ModelConfig`, its RoPE tables and presets.

`ModelConfig.from_name("tiny" | "V4-Flash" | "V4-Pro")`, `from_dict(config_json)` (transformers'
and DeepSeek's published fields) or `from_checkpoint(dir)`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from planner import contract
from planner.contract import LayerKind, LayerSpec

# ----------------------------------------------------------------------------- config

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

    `layer_types[i]` is layer i's kind in transformers' names (no MTP slot); CSA and HCA layers use
    `compress_rate_csa` / `compress_rate_hca` (any ratio >= 1; V4.0: 4 and 128); `layers` gives
    each layer's `planner.LayerSpec`. `mlp_layer_types[i]` is "hash_moe" or "moe". Build one with `from_name("tiny" | "V4-Flash" |
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
    layer_types: tuple[str, ...] = tuple(contract.PRESETS["V4-Flash"]["layer_types"])
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
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
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ValueError(
                f"layer_types / mlp_layer_types: need {n} entries each, got "
                f"{len(self.layer_types)} / {len(self.mlp_layer_types)}"
            )
        self.layers  # ValueError for unknown layer types or ratios < 1
        bad = [t for t in self.mlp_layer_types if t not in ("hash_moe", "moe")]
        if bad:
            raise ValueError(f"mlp_layer_types: entries must be 'hash_moe' or 'moe', got {bad}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func: expected one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"o_groups: {self.o_groups} does not divide num_attention_heads {self.num_attention_heads}"
            )
        if not 0 < self.rope_head_dim <= self.head_dim or self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim: expected an even value in 1..{self.head_dim}, got {self.rope_head_dim}")
        if self.index_head_dim < self.rope_head_dim:
            raise ValueError(
                f"index_head_dim: {self.index_head_dim} is smaller than rope_head_dim {self.rope_head_dim}"
            )

    @functools.cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        """Each layer's kind and compress ratio."""
        return contract.layer_specs(
            {
                "layer_types": list(self.layer_types),
                "compress_rates": {
                    "compressed_sparse_attention": self.compress_rate_csa,
                    "heavily_compressed_attention": self.compress_rate_hca,
                },
            }
        )

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        return tuple(s.kind for s in self.layers)

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        """Each layer's ratio (0 for SWA layers)."""
        return tuple(s.compress_ratio for s in self.layers)

    def compress_ratio(self, kind: LayerKind) -> int:
        """The ratio of `kind`'s layers (0 for SWA)."""
        kind = LayerKind.of(kind)
        if kind is LayerKind.SWA:
            return 0
        return self.compress_rate_csa if kind is LayerKind.CSA else self.compress_rate_hca

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise ValueError(f"name: expected one of {sorted(p.name for p in PRESETS.values())}, got {name!r}")
        return PRESETS[key]

    @classmethod
    def from_checkpoint(cls, path) -> ModelConfig:
        p = Path(path)
        if not (p / "config.json").is_file():
            raise ValueError(f"path: no config.json in {str(p)!r}")
        return cls.from_dict(json.loads((p / "config.json").read_text()), name=p.name)

    @classmethod
    def from_dict(cls, d: dict, name: str = "checkpoint") -> ModelConfig:
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
        if d.get("layer_types") is None and d.get("compress_ratios") is None:
            # transformers' default (HCA, HCA, HCA, CSA, ...: not the spec's V4-Pro parity)
            d = dict(
                d,
                layer_types=["heavily_compressed_attention"] * min(n, 2)
                + [
                    "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                    for i in range(max(n - 2, 0))
                ],
            )
        specs = contract.layer_specs(dict(d, num_hidden_layers=n))
        rates = {k: [s.compress_ratio for s in specs if s.kind is k] for k in (LayerKind.CSA, LayerKind.HCA)}
        dflt = contract.layer_specs(
            {
                "layer_types": [k.layer_type for k in (LayerKind.CSA, LayerKind.HCA)],
                **{key: d[key] for key in ("compress_rates", "compress_rate_csa", "compress_rate_hca") if key in d},
            }
        )
        csa_rate = rates[LayerKind.CSA][0] if rates[LayerKind.CSA] else dflt[0].compress_ratio
        hca_rate = rates[LayerKind.HCA][0] if rates[LayerKind.HCA] else dflt[1].compress_ratio
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
            layer_types=tuple(sp.kind.layer_type for sp in specs),
            compress_rate_csa=int(csa_rate),
            compress_rate_hca=int(hca_rate),
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


# The contract's one preset table (planner.contract.PRESETS), keyed case-insensitively.
PRESETS = {name.lower(): ModelConfig.from_dict(cfg, name=name) for name, cfg in contract.PRESETS.items()}
