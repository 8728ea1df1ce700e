"""Load DeepSeek-V4 safetensors checkpoints into `dsv4_jax.model` parameters, with NumPy only.

    config, params = load_checkpoint("path/to/checkpoint", dtype="float32")

Accepts transformers' tensor names (`model.layers.0.self_attn.q_a_proj.weight`, packed experts)
and DeepSeek's original names (`layers.0.attn.wq_a.weight`, per-expert `w1/w2/w3`), converted as
transformers' `conversion_mapping["deepseek_v4"]` does (docs/transformers-dsv4.md section 14).
`mtp.*` tensors (the unused next-token-prediction layer) are ignored. One `model.safetensors`, a
sharded `model.safetensors.index.json`, or every `*.safetensors` in the directory is read.
FP8 checkpoints (weights with `.scale` siblings) are refused: dequantize them first.

The parameter tree (`load_params`): linear weights `(out, in)` in the requested dtype; norm
weights, mHC `fn/base/scale`, sinks, compressor position biases (`ape`) and router correction
biases in float32 (transformers' `_keep_in_fp32_modules_strict`):

    embed (V, hidden), head (V, hidden), norm (hidden,), hc_head {fn (n, n*hidden), base (n,), scale (1,)}
    layers[i]: attn_norm, ffn_norm (hidden,); attn_hc, ffn_hc {fn ((2+n)n, n*hidden), base, scale (3,)}
      attn: wq_a (q_lora, hidden), q_norm (q_lora,), wq_b (H*D, q_lora), wkv (D, hidden), kv_norm (D,),
            wo_a (G, o_lora, H*D/G), wo_b (hidden, G*o_lora), sink (H,)
            compressor (CSA/HCA): wkv, wgate (C, hidden), ape (r, C), norm (D,)   C = 2D (CSA) or D
            indexer (CSA): wkv, wgate (2*dh, hidden), ape (4, 2*dh), norm (dh,), wq_b (nh*dh, q_lora),
                           weights_proj (nh, hidden)
      ffn: gate (E, hidden), bias (E,) f32 (top-k layers) or tid2eid (V, k) int32 (hash layers),
           w13 (E, hidden, 2I) [gate | up], w2 (E, I, hidden), shared_w1, shared_w3 (I, hidden), shared_w2 (hidden, I)
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4_jax.model.config import ModelConfig
from planner import LayerKind

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# ----------------------------------------------------------------------------- reading

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}  # fmt: skip


def _read_raw(path: Path) -> dict[str, np.ndarray]:
    """Parse a safetensors file directly (for dtypes NumPy lacks: bfloat16, float8)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        a, b = info["data_offsets"]
        arr = np.frombuffer(data, dtype=_ST_DTYPES[info["dtype"]], count=int(np.prod(info["shape"], dtype=np.int64)),
                            offset=8 + n + a)  # fmt: skip
        if arr.nbytes != b - a:
            raise ValueError(f"{path}: tensor {name!r} has {b - a} bytes for shape {info['shape']}")
        out[name] = arr.reshape(info["shape"])
    return out


def read_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (or one .safetensors file), by name."""
    from safetensors.numpy import load_file

    p = Path(path)
    if p.is_file():
        files = [p]
    elif (p / "model.safetensors.index.json").is_file():
        index = json.loads((p / "model.safetensors.index.json").read_text())
        files = sorted({p / f for f in index["weight_map"].values()})
    elif (p / "model.safetensors").is_file():
        files = [p / "model.safetensors"]
    else:
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        raise ValueError(f"path: no safetensors files in {str(p)!r}")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except TypeError:  # bfloat16 / float8: NumPy has no such dtype, read the bytes ourselves
            part = _read_raw(f)
        dup = set(part) & set(tensors)
        if dup:
            raise ValueError(f"path: tensor {sorted(dup)[0]!r} appears in more than one file")
        tensors.update(part)
    return tensors


# ----------------------------------------------------------------------------- names

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


def to_transformers_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Any of the name styles transformers loads -> transformers' names (notes section 14).

    Per tensor: DeepSeek's original names (`layers.{i}.attn.wq_a.weight`, `embed.weight`, ...),
    the same layer names under `model.` (what transformers' `save_pretrained` writes), and
    transformers' own names. Per-expert w1/w3 are stacked and concatenated into `gate_up_proj`
    (E, 2I, hidden), w2 into `down_proj` (E, hidden, I); `mtp.*` is dropped. Names this does not
    know pass through, and `load_params` refuses what it does not use."""
    out: dict[str, np.ndarray] = {}
    experts: dict[int, dict[str, dict[int, np.ndarray]]] = {}
    for name, t in tensors.items():
        if name.startswith(("mtp.", "model.mtp.")):
            continue
        if name.endswith(".scale") and not re.search(r"hc_(attn|ffn|head)_scale$|\.(attn|ffn)_hc\.scale$|hc_scale$", name):
            raise ValueError(f"tensors: {name!r} is an FP8 scale; FP8 checkpoints are not supported (dequantize first)")
        key = name[len("model.") :] if name.startswith("model.layers.") else name
        if key in _DEEPSEEK_TOP:
            out[_DEEPSEEK_TOP[key]] = t
            continue
        m = _EXPERT.match(key)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(m[3], {})[int(m[2])] = t
            continue
        if key.startswith("layers."):
            i, rest = key[len("layers.") :].split(".", 1)
            rest = _LAYER_ALIASES.get(rest, rest)
            hf = f"model.layers.{i}.{_DEEPSEEK_LAYER_MAP.get(rest, rest)}"
            out[_SAVED_NORM.sub(r".\1.kv_norm.weight", hf)] = t
            continue
        out[name] = t
    for i, ws in experts.items():
        ids = sorted(ws.get("w1", {}))
        for w in ("w1", "w2", "w3"):
            if sorted(ws.get(w, {})) != ids or ids != list(range(len(ids))):
                raise ValueError(f"tensors: layer {i} has experts {ids} for w1 but {sorted(ws.get(w, {}))} for {w}")
        gate_up = np.stack([np.concatenate([ws["w1"][e], ws["w3"][e]], axis=0) for e in ids])
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up
        out[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack([ws["w2"][e] for e in ids])
    return out


# ----------------------------------------------------------------------------- parameters


def load_params(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype="float32") -> dict:
    """The model's parameter tree (module docstring) from tensors in either name style."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    dt = DTYPES[dtype]
    sd = dict(to_transformers_names(tensors))
    used: set[str] = set()
    H, D, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    hid, n, E = cfg.hidden_size, cfg.hc_mult, cfg.n_routed_experts
    inter, qr = cfg.moe_intermediate_size, cfg.q_lora_rank

    def get(name, shape, kind="w"):
        if name not in sd:
            raise ValueError(f"tensors: missing {name!r}")
        a = sd[name]
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"tensors: {name!r} has shape {tuple(a.shape)}, the config needs {tuple(shape)}")
        used.add(name)
        if kind == "int":
            return jnp.asarray(a.astype(np.int32))
        if a.dtype.kind not in "fV" and str(a.dtype) not in ("bfloat16",):
            raise ValueError(f"tensors: {name!r} has dtype {a.dtype}, expected floating point")
        if "float8" in str(a.dtype):
            raise ValueError(f"tensors: {name!r} is {a.dtype}; FP8 checkpoints are not supported (dequantize first)")
        return jnp.asarray(np.asarray(a, dtype=np.float32), dtype=jnp.float32 if kind == "f32" else dt)

    def hc(prefix, rows):
        return {"fn": get(prefix + "fn", (rows, n * hid), "f32"), "base": get(prefix + "base", (rows,), "f32"),
                "scale": get(prefix + "scale", (3,), "f32")}  # fmt: skip

    params = {"embed": get("model.embed_tokens.weight", (cfg.vocab_size, hid))}
    layers = []
    for i, (kind, mtype) in enumerate(zip(cfg.kinds, cfg.mlp_layer_types)):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn = {
            "wq_a": get(a + "q_a_proj.weight", (qr, hid)),
            "q_norm": get(a + "q_a_norm.weight", (qr,), "f32"),
            "wq_b": get(a + "q_b_proj.weight", (H * D, qr)),
            "wkv": get(a + "kv_proj.weight", (D, hid)),
            "kv_norm": get(a + "kv_norm.weight", (D,), "f32"),
            "wo_a": get(a + "o_a_proj.weight", (G * cfg.o_lora_rank, H * D // G)).reshape(G, cfg.o_lora_rank, -1),
            "wo_b": get(a + "o_b_proj.weight", (hid, G * cfg.o_lora_rank)),
            "sink": get(a + "sinks", (H,), "f32"),
        }
        if kind is not LayerKind.SWA:
            c = a + "compressor."
            width = (2 if kind is LayerKind.CSA else 1) * D
            attn["compressor"] = {
                "wkv": get(c + "kv_proj.weight", (width, hid)),
                "wgate": get(c + "gate_proj.weight", (width, hid)),
                "ape": get(c + "position_bias", (cfg.compress_ratio(kind), width), "f32"),
                "norm": get(c + "kv_norm.weight", (D,), "f32"),
            }
        if kind is LayerKind.CSA:
            x = a + "compressor.indexer."
            nh, dh = cfg.index_n_heads, cfg.index_head_dim
            attn["indexer"] = {
                "wkv": get(x + "kv_proj.weight", (2 * dh, hid)),
                "wgate": get(x + "gate_proj.weight", (2 * dh, hid)),
                "ape": get(x + "position_bias", (4, 2 * dh), "f32"),
                "norm": get(x + "kv_norm.weight", (dh,), "f32"),
                "wq_b": get(x + "q_b_proj.weight", (nh * dh, qr)),
                "weights_proj": get(x + "scorer.weights_proj.weight", (nh, hid)),
            }
        m = p + "mlp."
        ffn = {
            "gate": get(m + "gate.weight", (E, hid)),
            "w13": jnp.swapaxes(get(m + "experts.gate_up_proj", (E, 2 * inter, hid)), 1, 2),
            "w2": jnp.swapaxes(get(m + "experts.down_proj", (E, hid, inter)), 1, 2),
            "shared_w1": get(m + "shared_experts.gate_proj.weight", (inter, hid)),
            "shared_w3": get(m + "shared_experts.up_proj.weight", (inter, hid)),
            "shared_w2": get(m + "shared_experts.down_proj.weight", (hid, inter)),
        }
        if mtype == "hash_moe":
            ffn["tid2eid"] = get(m + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "int")
            if int(ffn["tid2eid"].min()) < 0 or int(ffn["tid2eid"].max()) >= E:
                raise ValueError(f"tensors: {m + 'gate.tid2eid'!r} holds expert ids outside 0..{E - 1}")
        else:
            ffn["bias"] = get(m + "gate.e_score_correction_bias", (E,), "f32")
        layers.append({
            "attn_norm": get(p + "input_layernorm.weight", (hid,), "f32"),
            "ffn_norm": get(p + "post_attention_layernorm.weight", (hid,), "f32"),
            "attn_hc": hc(p + "attn_hc.", (2 + n) * n),
            "ffn_hc": hc(p + "ffn_hc.", (2 + n) * n),
            "attn": attn,
            "ffn": ffn,
        })  # fmt: skip
    params["layers"] = layers
    params["norm"] = get("model.norm.weight", (hid,), "f32")
    params["hc_head"] = {
        "fn": get("model.hc_head.hc_fn", (n, n * hid), "f32"),
        "base": get("model.hc_head.hc_base", (n,), "f32"),
        "scale": get("model.hc_head.hc_scale", (1,), "f32"),
    }
    if "lm_head.weight" in sd or not cfg.tie_word_embeddings:
        params["head"] = get("lm_head.weight", (cfg.vocab_size, hid))
    else:
        params["head"] = params["embed"]
    unused = sorted(set(sd) - used)
    if unused:
        raise ValueError(f"tensors: {len(unused)} tensors the config does not use, e.g. {unused[:3]}")
    return params


def load_checkpoint(path, dtype="float32") -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a checkpoint directory: config.json + safetensors, either name style."""
    cfg = ModelConfig.from_checkpoint(path)
    return cfg, load_params(cfg, read_safetensors(path), dtype)
