"""DeepSeek-V4.1 hyper-parameters for the JAX model: `V41Config`.

`V41Config.from_dict(config_json)` reads transformers' `DeepseekV41TextConfig` fields (flat,
`model_type` "deepseek_v41_text"), transformers' composite `DeepseekV41Config` / the official
release's config.json (`model_type` "deepseek_v41", the text fields under `text_config`, the
official `n_mtp_layers`), with transformers' defaults for absent fields; `from_checkpoint(dir)`
reads a checkpoint's config.json; `from_name("V4.1" | "V4.1-tiny")` a preset of
`planner.contract.V41_PRESETS`. The layer schedule (which layer owns, reads and reindexes which
compressed cache, the candidate source, the replay cut) is the planner's `Schedule`, with its
checks; `V41Config.schedule` holds it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from dsv4_jax.model.config import RopeConfig, _first, _rope_configs
from planner.checks import as_int
from planner.contract import V41_MODEL_TYPES, V41_PRESETS, preset
from planner.schedule import Schedule, text_config

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softplus")


@dataclass(frozen=True)
class V41Config:
    """DeepSeek-V4.1 text-model hyper-parameters (transformers' `DeepseekV41TextConfig` names and
    defaults, released DeepSeek-V4.1-Flash). Draft (DSpark) and vision parts are not modelled."""

    name: str = dataclasses.field(default="V4.1", compare=False)
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    compress_ratios: tuple[int, ...] = ()
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    sliding_window: int = 128
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    rope_main: RopeConfig = RopeConfig()
    rope_compress: RopeConfig = RopeConfig("yarn", 160000.0, 16.0, 65536, 32.0, 1.0, 1.0)
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1

    model_type = "deepseek_v41"  # (a class attribute: how callers tell a V4.1 config)

    def __post_init__(self):
        self.schedule  # the planner's checks: ValueError naming the field
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n:
            raise ValueError(f"compress_ratios: need num_hidden_layers = {n} entries, got {len(self.compress_ratios)}")
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
        sched = self.schedule
        if sched.candidate_source_layer_id >= 0:
            # The candidates must hold index_topk entries whenever there are more visible: all
            # blocks but the pinned newest one (which may hold a single entry) are full.
            held = (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1
            if held < self.index_topk:
                raise ValueError(
                    f"candidate_topk_blocks: {self.candidate_topk_blocks} blocks of candidate_block_size "
                    f"{self.candidate_block_size} hold as few as {held} entries (the newest block may hold one), "
                    f"fewer than index_topk = {self.index_topk}"
                )
            src = sched[sched.candidate_source_layer_id].kv_source_layer_id
            for role in sched:
                if role.uses_candidates and role.kv_source_layer_id != src:
                    raise ValueError(
                        f"candidate_source_layer_id: layer {role.layer_id} takes its top-k inside the candidates "
                        f"of layer {sched.candidate_source_layer_id}, but reads KV source {role.kv_source_layer_id}'s "
                        f"cache, not {src}'s (the candidate blocks index that cache)"
                    )
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError(
                f"engram_num_embeddings: {len(self.engram_num_embeddings)} entries for "
                f"{len(self.engram_layer_ids)} engram_layer_ids"
            )
        if self.engram_layer_ids:
            as_int(self.engram_max_ngram_size, "engram_max_ngram_size", minimum=2)
            as_int(self.engram_n_heads, "engram_n_heads", minimum=1)
            as_int(self.engram_head_dim, "engram_head_dim", minimum=1)
            as_int(self.engram_vocab_size, "engram_vocab_size", minimum=2)
            as_int(self.engram_compressed_vocab_size, "engram_compressed_vocab_size", minimum=1)

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The planner's V4.1 layer schedule (roles, sources, candidate source, replay cut)."""
        return Schedule(
            compress_ratios=self.compress_ratios,
            kv_source_layer_ids=self.kv_source_layer_ids,
            index_source_layer_ids=self.index_source_layer_ids,
            candidate_source_layer_id=self.candidate_source_layer_id,
            candidate_topk_blocks=self.candidate_topk_blocks,
            candidate_block_size=self.candidate_block_size,
            index_topk=self.index_topk,
            sliding_window=self.sliding_window,
            engram_layer_ids=self.engram_layer_ids,
        )

    @property
    def layers(self):
        """Every layer's `planner.LayerSpec` (SWA for ratio 0, CSA at its ratio otherwise)."""
        return self.schedule.layer_specs

    @classmethod
    def from_name(cls, name: str) -> V41Config:
        key = name.lower().replace("_", "-")
        names = {k.lower(): k for k in V41_PRESETS}
        if key not in names:
            raise ValueError(f"name: expected one of {sorted(V41_PRESETS)}, got {name!r}")
        return cls.from_dict(preset(names[key]), name=names[key])

    @classmethod
    def from_checkpoint(cls, path) -> V41Config:
        p = Path(path)
        if not (p / "config.json").is_file():
            raise ValueError(f"path: no config.json in {str(p)!r}")
        return cls.from_dict(json.loads((p / "config.json").read_text()), name=p.name)

    @classmethod
    def from_dict(cls, d: dict, name: str = "checkpoint") -> V41Config:
        """A V4.1 config.json dict (transformers' text config, its composite, or the official one)."""
        if not isinstance(d, dict):
            raise TypeError(f"d: expected a dict (config.json), got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in V41_MODEL_TYPES:
            raise ValueError(f"model_type: expected one of {V41_MODEL_TYPES}, got {model_type!r}")
        t = {k: v for k, v in text_config(d).items() if v is not None}
        sched = Schedule.from_config(t)  # transformers' defaults for the schedule fields
        if t.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {t['hidden_act']!r}")
        if int(t.get("num_key_value_heads", 1)) != 1:
            raise ValueError(f"num_key_value_heads: V4.1 shares one KV latent, got {t['num_key_value_heads']}")
        if int(t.get("n_shared_experts", 1)) != 1:
            raise ValueError(f"n_shared_experts: only 1 is supported, got {t['n_shared_experts']}")
        if t.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"topk_method: only 'noaux_tc' is supported, got {t['topk_method']!r}")
        head_dim = int(t.get("head_dim", 512))
        rope_dim = int(t.get("qk_rope_head_dim", 64))
        main, compress = _rope_configs(t)
        engram = tuple(int(i) for i in t.get("engram_layer_ids", ()))
        emb = t.get("engram_num_embeddings")
        return cls(
            name=name,
            vocab_size=int(t.get("vocab_size", 129280)),
            hidden_size=int(t.get("hidden_size", 5120)),
            num_hidden_layers=sched.num_layers,
            num_attention_heads=int(t.get("num_attention_heads", 64)),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=int(t.get("q_lora_rank", 1280)),
            o_groups=int(t.get("o_groups", 8)),
            o_lora_rank=int(t.get("o_lora_rank", 1024)),
            compress_ratios=sched.compress_ratios,
            kv_source_layer_ids=sched.kv_source_layer_ids,
            index_source_layer_ids=sched.index_source_layer_ids,
            candidate_source_layer_id=sched.candidate_source_layer_id,
            candidate_topk_blocks=sched.candidate_topk_blocks,
            candidate_block_size=sched.candidate_block_size,
            sliding_window=sched.sliding_window,
            index_n_heads=int(t.get("index_n_heads", 32)),
            index_head_dim=int(t.get("index_head_dim", 128)),
            index_topk=sched.index_topk,
            moe_intermediate_size=int(t.get("moe_intermediate_size", t.get("intermediate_size", 2304))),
            n_routed_experts=int(t.get("n_routed_experts", t.get("num_local_experts", 384))),
            num_experts_per_tok=int(t.get("num_experts_per_tok", 6)),
            scoring_func=str(t.get("scoring_func", "sqrtsoftplus")),
            gate_temp=float(t.get("gate_temp", 1.0)),
            norm_topk_prob=bool(t.get("norm_topk_prob", True)),
            routed_scaling_factor=float(t.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(t.get("swiglu_limit", 10.0)),
            hc_mult=int(t.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(t.get("hc_eps", 1e-6)),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-20)),
            rope_main=main,
            rope_compress=compress,
            engram_layer_ids=engram,
            engram_vocab_size=int(t.get("engram_vocab_size", 16000000)),
            engram_num_embeddings=tuple(int(x) for x in (emb if emb is not None else [0] * len(engram))),
            engram_max_ngram_size=int(t.get("engram_max_ngram_size", 4)),
            engram_n_heads=int(t.get("engram_n_heads", 8)),
            engram_head_dim=int(t.get("engram_head_dim", 256)),
            engram_pad_id=int(t.get("engram_pad_id", 2)),
            engram_compressed_vocab_size=int(t.get("engram_compressed_vocab_size", 99092)),
            max_position_embeddings=int(t.get("max_position_embeddings", 1048576)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            bos_token_id=int(t.get("bos_token_id", 0) or 0),
            eos_token_id=int(_first(t.get("eos_token_id", 1))),
        )
