"""Load DeepSeek-V4.1 safetensors checkpoints into `dsv4_jax.model.v41` parameters (NumPy +
ml_dtypes, no torch), through the V4 loader's machinery (`dsv4_jax.model.checkpoint`: headers
checked first, then tensor by tensor onto the devices, FP8 / FP4 kept quantized or dequantized).

Two formats:
* transformers' (`DeepseekV41ForCausalLM.save_pretrained`; config `model_type`
  "deepseek_v41_text", or the composite "deepseek_v41"): `model.embed.weight`,
  `model.layers.{i}.attn.wq_a.weight`, per-expert `model.layers.{i}.ffn.experts.{e}.w1.weight`,
  `model.layers.{i}.hc_attn_fn`, `model.layers.{i}.engram.embed.weight`, ..., `lm_head.weight`.
* the official release's: the same names without `model.` (`layers.{i}.attn.wq_a.weight`,
  `embed.weight`, `norm.weight`, `head.weight`), FP8 linears (F8_E4M3 `.weight` + F8_E8M0
  `.scale`, blocks of `quantization_config.weight_block_size`, 32x32 for V4.1), FP4 routed
  experts (I8 packed e2m1 + F8_E8M0 `.scale` per 32 inputs), an FP8 Engram table with a UE8M0
  scale per 32 dims of a row (`engram.embed.scale`), `mtp.*` / `vision.*` / `aligner.*` /
  `image_*` tensors (not used by the text model: ignored).

transformers loads a float Engram table as a plain embedding (its `scale` unused); so does this
loader. `ffn.gate.bias_vl` (the image-token router bias) is read past: text only.

The parameter tree (weights as (out, in)):

    embed (V, hidden), head (V, hidden), norm (hidden,)
    layers[i]: attn_norm, ffn_norm (hidden,); attn_hc, ffn_hc {fn ((2+n)n, n*hidden), base, scale (3,)}
      attn: wq_a, q_norm, wq_b (H*D, q_lora), wkv (D, hidden), kv_norm, wo_a, wo_b, sink (H,)
            compressor (KV sources): wkv (D, hidden), wgate (D, hidden) (ratio 2), norm (D,)
            indexer (index sources): wq_b (nh*dh, q_lora), weights_proj (nh, hidden),
                                     wk (dh, D), k_norm (dh,) (KV sources only)
      ffn: gate (E, hidden), bias (E,), w13 (E, 2I, hidden), w2 (E, hidden, I), shared_w1/w3/w2
      engram (Engram layers): embed (rows, engram_head_dim), wkv (hidden*(n+1), cols*head_dim),
                              q_weight, k_weight (n, hidden)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax

from dsv4_jax.model import parallel
from dsv4_jax.model.checkpoint import (
    DTYPES,
    WEIGHTS,
    _check,
    _DictTensors,
    _Entry,
    _place,
    quant_block,
)
from dsv4_jax.model.names import Part, Source, _scale_pairs
from dsv4_jax.model.quant import FP8_BLOCK
from dsv4_jax.model.safetensors_io import CheckpointFiles
from dsv4_jax.model.v41_config import V41Config

_IGNORED = ("mtp.", "vision.", "aligner.", "image_")
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_TOP = {"model.embed.weight": "embed.weight", "model.norm.weight": "norm.weight", "lm_head.weight": "head.weight"}
ENGRAM_BLOCK = (1, 32)  # the FP8 Engram table: one UE8M0 scale per 32 dims of a row


def canonical_name(name: str) -> str | None:
    """A checkpoint name in either format -> the official one (None: not part of the text model)."""
    if name in _TOP:
        return _TOP[name]
    key = name[len("model.") :] if name.startswith("model.") else name
    if key.startswith(_IGNORED) or key.endswith("ffn.gate.bias_vl"):
        return None
    return key


def v41_sources(names) -> dict[str, Source]:
    """canonical name -> Source for every tensor of the text model; routed experts stacked into
    `layers.{i}.ffn.w13` ([w1, w3] rows) and `layers.{i}.ffn.w2`."""
    names = list(names)
    scales = _scale_pairs(names)
    out: dict[str, Source] = {}
    experts: dict[int, dict[str, dict[int, Part]]] = {}
    scale_names = set(scales.values())
    for name in names:
        key = canonical_name(name)
        if key is None or name in scale_names:
            continue
        part = Part(name, scales.get(name))
        m = _EXPERT.match(key)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(m[3], {})[int(m[2])] = part
            continue
        if key in out:
            raise ValueError(f"tensors: {name!r} and {out[key].part.name!r} are the same model tensor {key!r}")
        out[key] = Source(part=part)
    for i, ws in experts.items():
        ids = sorted(ws.get("w1", {}))
        for w in ("w1", "w2", "w3"):
            if sorted(ws.get(w, {})) != ids or ids != list(range(len(ids))):
                raise ValueError(f"tensors: layer {i} has experts {ids} for w1 but {sorted(ws.get(w, {}))} for {w}")
        out[f"layers.{i}.ffn.w13"] = Source(experts=tuple((ws["w1"][e], ws["w3"][e]) for e in ids))
        out[f"layers.{i}.ffn.w2"] = Source(experts=tuple((ws["w2"][e],) for e in ids))
    return out


def plan_params(cfg: V41Config, files, block_size: tuple[int, int] = FP8_BLOCK):
    """The parameter tree with an `_Entry` per tensor, every name, dtype and shape checked
    against `cfg` from the headers alone; and whether the head is the tied embedding."""
    sources = v41_sources(files.names())
    used: set[str] = set()
    H, D, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    hid, n, E = cfg.hidden_size, cfg.hc_mult, cfg.n_routed_experts
    inter, qr = cfg.moe_intermediate_size, cfg.q_lora_rank
    nh, dh = cfg.index_n_heads, cfg.index_head_dim

    def get(name, shape, kind="w", role="", block=None):
        if name not in sources:
            raise ValueError(f"tensors: missing {name!r}")
        used.add(name)
        return _check(files, role, sources[name], name, shape, kind, block or block_size)

    def hc(prefix):
        rows = (2 + n) * n
        return {
            "fn": get(prefix + "_fn", (rows, n * hid), "f32"),
            "base": get(prefix + "_base", (rows,), "f32"),
            "scale": get(prefix + "_scale", (3,), "f32"),
        }

    tree = {"embed": get("embed.weight", (cfg.vocab_size, hid), "emb", role="embed")}
    layers = []
    for role in cfg.schedule:
        i = role.layer_id
        p = f"layers.{i}."
        a = p + "attn."
        attn = {
            "wq_a": get(a + "wq_a.weight", (qr, hid)),
            "q_norm": get(a + "q_norm.weight", (qr,), "f32"),
            "wq_b": get(a + "wq_b.weight", (H * D, qr), role="attn.wq_b"),
            "wkv": get(a + "wkv.weight", (D, hid)),
            "kv_norm": get(a + "kv_norm.weight", (D,), "f32"),
            "wo_a": get(a + "wo_a.weight", (G * cfg.o_lora_rank, H * D // G), role="attn.wo_a"),
            "wo_b": get(a + "wo_b.weight", (hid, G * cfg.o_lora_rank), role="attn.wo_b"),
            "sink": get(a + "attn_sink", (H,), "f32", role="attn.sink"),
        }
        if role.is_kv_source:
            c = a + "compressor."
            attn["compressor"] = {"wkv": get(c + "wkv.weight", (D, hid)), "norm": get(c + "norm.weight", (D,), "f32")}
            if role.compress_ratio > 1:
                attn["compressor"]["wgate"] = get(c + "wgate.weight", (D, hid))
        if role.is_index_source:
            x = a + "indexer."
            attn["indexer"] = {
                "wq_b": get(x + "wq_b.weight", (nh * dh, qr)),
                "weights_proj": get(x + "weights_proj.weight", (nh, hid)),
            }
            if role.is_kv_source:
                attn["indexer"]["wk"] = get(x + "wk.weight", (dh, D))
                attn["indexer"]["k_norm"] = get(x + "k_norm.weight", (dh,), "f32")
        m = p + "ffn."
        ffn = {
            "gate": get(m + "gate.weight", (E, hid)),
            "bias": get(m + "gate.bias", (E,), "f32"),
            "w13": get(m + "w13", (E, 2 * inter, hid), role="ffn.w13"),
            "w2": get(m + "w2", (E, hid, inter), role="ffn.w2"),
            "shared_w1": get(m + "shared_experts.w1.weight", (inter, hid), role="ffn.shared_w1"),
            "shared_w3": get(m + "shared_experts.w3.weight", (inter, hid), role="ffn.shared_w3"),
            "shared_w2": get(m + "shared_experts.w2.weight", (hid, inter), role="ffn.shared_w2"),
        }
        layer = {
            "attn_norm": get(p + "attn_norm.weight", (hid,), "f32"),
            "ffn_norm": get(p + "ffn_norm.weight", (hid,), "f32"),
            "attn_hc": hc(p + "hc_attn"),
            "ffn_hc": hc(p + "hc_ffn"),
            "attn": attn,
            "ffn": ffn,
        }
        if i in cfg.engram_layer_ids:
            e = p + "engram."
            k = cfg.engram_layer_ids.index(i)
            rows, edim = cfg.engram_num_embeddings[k], cfg.engram_head_dim
            cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            table = sources.get(e + "embed.weight")
            if table is not None and table.part.scale is not None and files.info(table.part.name).st_dtype != "F8_E4M3":
                # a float table (transformers' format): its `scale` is unused, as in transformers
                sources[e + "embed.weight"] = Source(part=Part(table.part.name))
            layer["engram"] = {
                "embed": get(e + "embed.weight", (rows, edim), role="engram.embed", block=ENGRAM_BLOCK),
                "wkv": get(e + "wkv.weight", (hid * (n + 1), cols * edim)),
                "q_weight": get(e + "q_weight", (n, hid), "f32"),
                "k_weight": get(e + "k_weight", (n, hid), "f32"),
            }
            used.add(e + "embed.scale")
        layers.append(layer)
    tree["layers"] = layers
    tree["norm"] = get("norm.weight", (hid,), "f32")
    tied = "head.weight" not in sources and cfg.tie_word_embeddings
    if not tied:
        tree["head"] = get("head.weight", (cfg.vocab_size, hid), role="head")
    unused = sorted(set(sources) - used)
    if unused:
        raise ValueError(f"tensors: {len(unused)} tensors the config does not use, e.g. {unused[:3]}")
    return tree, tied


def load_params(
    cfg: V41Config,
    tensors,
    dtype="float32",
    *,
    weights: str = "stored",
    mesh=None,
    axis=None,
    block_size: tuple[int, int] = FP8_BLOCK,
) -> dict:
    """The V4.1 parameter tree from `tensors` (a `CheckpointFiles` or a dict of NumPy arrays,
    either format); as `dsv4_jax.model.checkpoint.load_params`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {WEIGHTS}, got {weights!r}")
    files = tensors if isinstance(tensors, CheckpointFiles) else _DictTensors(tensors)
    mesh, axis = parallel.resolve_mesh(mesh, axis)
    if mesh is not None:
        parallel.check_divisible(cfg, mesh, axis)
    tree, tied = plan_params(cfg, files, block_size)
    dt = DTYPES[dtype]
    params = jax.tree.map(
        lambda e: _place(files, e, dt, weights, mesh, axis), tree, is_leaf=lambda x: isinstance(x, _Entry)
    )
    if tied:
        params["head"] = params["embed"]
    return params


def load_checkpoint(path, dtype="float32", *, weights: str = "stored", mesh=None, axis=None):
    """(V41Config, params) of a V4.1 checkpoint directory (config.json + safetensors)."""
    cfg = V41Config.from_checkpoint(path)
    block = quant_block(json.loads((Path(path) / "config.json").read_text()))
    files = CheckpointFiles(path)
    try:
        return cfg, load_params(cfg, files, dtype, weights=weights, mesh=mesh, axis=axis, block_size=block)
    finally:
        files.close()


__all__ = ["canonical_name", "load_checkpoint", "load_params", "plan_params", "v41_sources"]
