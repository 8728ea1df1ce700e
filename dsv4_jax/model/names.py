"""Tensor names of DeepSeek-V4 checkpoints: DeepSeek's own (the official release, `mtp.0.*`,
per-expert `w1/w2/w3`, `.scale` FP8 scales) and transformers' (`model.layers.0.self_attn.q_a_proj`,
packed experts, `weight_scale_inv`), mapped as transformers' `conversion_mapping["deepseek_v4"]`
does (docs/transformers-dsv4.md section 14). `dsv4_jax.model.checkpoint` loads through this map.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_DEEPSEEK_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_DEEPSEEK_LAYER = [  # DeepSeek suffix -> transformers suffix inside layers.{i}.
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
]
_DEEPSEEK_LAYER_MAP = dict(_DEEPSEEK_LAYER)
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
# transformers' `save_pretrained` undoes its load-time renames: DeepSeek's layer names come back
# under "model.", and every attention-side "kv_norm" comes back as "norm" (the reverse of its
# ".norm." -> ".kv_norm." rename), whichever style the model was loaded from.
_LAYER_ALIASES = {"attn.norm.weight": "attn.kv_norm.weight"}
_SAVED_NORM = re.compile(r"\.(self_attn(?:\.compressor(?:\.indexer)?)?)\.norm\.weight$")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")  # DeepSeek's, transformers' FP8 scale names


def _is_mtp(name: str) -> bool:
    return name.startswith(("mtp.", "model.mtp."))


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor of a model tensor, with its scale tensor if it is quantized."""

    name: str
    scale: str | None = None


@dataclass(frozen=True)
class Source:
    """Where one model tensor (transformers' name) comes from: one part, or routed experts stacked
    from per-expert parts (`experts[e]` = the parts concatenated on rows: [w1, w3] or [w2])."""

    part: Part | None = None
    experts: tuple[tuple[Part, ...], ...] | None = None


def _scale_pairs(names) -> dict[str, str]:
    """weight name -> its scale's name (a `.scale` / `.weight_scale_inv` sibling of a `.weight`)."""
    names = set(names)
    pairs = {}
    for n in names:
        for suffix in _SCALE_SUFFIXES:
            if n.endswith(suffix):
                w = n[: -len(suffix)] + ".weight"
                if w in names:
                    pairs[w] = n
    return pairs


def transformers_name(name: str) -> str | None:
    """A checkpoint name in any style -> transformers' name (None for per-expert tensors)."""
    key = name[len("model.") :] if name.startswith("model.layers.") else name
    if key in _DEEPSEEK_TOP:
        return _DEEPSEEK_TOP[key]
    if _EXPERT.match(key):
        return None
    if key.startswith("layers."):
        i, rest = key[len("layers.") :].split(".", 1)
        rest = _LAYER_ALIASES.get(rest, rest)
        hf = f"model.layers.{i}.{_DEEPSEEK_LAYER_MAP.get(rest, rest)}"
        return _SAVED_NORM.sub(r".\1.kv_norm.weight", hf)
    return name


def weight_sources(names) -> tuple[dict[str, Source], list[str]]:
    """transformers name -> Source for every checkpoint tensor, and the MTP names (unused)."""
    names = list(names)
    scales = _scale_pairs(names)
    scale_names = set(scales.values())
    out: dict[str, Source] = {}
    mtp: list[str] = []
    experts: dict[int, dict[str, dict[int, Part]]] = {}
    for name in names:
        if _is_mtp(name):
            mtp.append(name)
            continue
        if name in scale_names:
            continue
        part = Part(name, scales.get(name))
        key = name[len("model.") :] if name.startswith("model.layers.") else name
        m = _EXPERT.match(key)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(m[3], {})[int(m[2])] = part
            continue
        hf = transformers_name(name)
        if hf in out:
            raise ValueError(f"tensors: {name!r} and {out[hf].part.name!r} are the same model tensor {hf!r}")
        out[hf] = Source(part=part)
    for i, ws in experts.items():
        ids = sorted(ws.get("w1", {}))
        for w in ("w1", "w2", "w3"):
            if sorted(ws.get(w, {})) != ids or ids != list(range(len(ids))):
                raise ValueError(f"tensors: layer {i} has experts {ids} for w1 but {sorted(ws.get(w, {}))} for {w}")
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = Source(
            experts=tuple((ws["w1"][e], ws["w3"][e]) for e in ids)
        )
        out[f"model.layers.{i}.mlp.experts.down_proj"] = Source(experts=tuple((ws["w2"][e],) for e in ids))
    return out, mtp


def to_transformers_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Any of the name styles transformers loads -> transformers' names (notes section 14), for
    unquantized tensors in memory. Per-expert w1/w3 are stacked and concatenated into
    `gate_up_proj` (E, 2I, hidden), w2 into `down_proj` (E, hidden, I); `mtp.*` is dropped.
    Quantized tensors (with a scale) raise: `load_params` reads them."""
    sources, _ = weight_sources(tensors)
    out = {}
    for hf, src in sources.items():
        parts = [src.part] if src.part else [p for ps in src.experts for p in ps]
        for p in parts:
            if p.scale is not None:
                raise ValueError(f"tensors: {p.name!r} is quantized (scale {p.scale!r}); load it with load_params")
        if src.part:
            out[hf] = tensors[src.part.name]
        else:
            out[hf] = np.stack([np.concatenate([tensors[p.name] for p in ps], axis=0) for ps in src.experts])
    return out
