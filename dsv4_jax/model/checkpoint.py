"""Load DeepSeek-V4 safetensors checkpoints into `dsv4_jax.model` parameters: NumPy + ml_dtypes, no torch.

    config, params = load_checkpoint("path/to/checkpoint", dtype="bfloat16")               # as shipped
    config, params = load_checkpoint(path, dtype="bfloat16", weights="dequantized")        # bf16 at load
    config, params = load_checkpoint(path, mesh=mesh, axis="tp")                          # sharded

What it reads:
* The official release as shipped (docs: real-formats.md section 2): DeepSeek's names
  (`layers.0.attn.wq_a.weight`, per-expert `ffn.experts.E.w{1,2,3}`), FP8 linears (F8_E4M3
  `.weight` + F8_E8M0 `.scale`, 128x128 blocks, `quantization_config.weight_block_size`), FP4
  routed experts (I8 `.weight` of packed e2m1 pairs + F8_E8M0 `.scale` per 32 inputs), V4-Flash-Base
  FP8 experts with F32 scales, BF16/F32 tensors, `mtp.0.*` (headers read and checked; the model
  does not use the MTP layer), one file or a sharded `model.safetensors.index.json`.
* transformers' names (`model.layers.0.self_attn.q_a_proj.weight`, packed `experts.gate_up_proj`),
  what its `save_pretrained` writes, and FP8 scales named `weight_scale_inv`; names are converted
  as transformers' `conversion_mapping["deepseek_v4"]` does (docs/transformers-dsv4.md section 14).

How: headers first (every name, dtype and shape is checked against the config before a byte is
read), then tensor by tensor, device shard by device shard: each shard's slice is copied out of
the memory-mapped file, put on its device, and the file's pages are released; routed experts are
stacked on the device from per-expert pieces. Host memory stays about one tensor (one expert for
the experts), whatever the model's size (`python -m bench.bench_jax_load` measures it).

`weights=`:
* "stored" (default): every tensor as the checkpoint holds it. FP8 and FP4 linears become
  `dsv4_jax.model.quant.QuantizedWeight`s (e4m3 / packed e2m1 data + E8M0 exponent bytes or F32
  scales), dequantized inside the jitted matmuls; BF16 / F32 tensors keep their dtype (the model
  casts them to `dtype` where it computes); integers become int32.
* "dequantized": every linear weight in `dtype` at load (FP8 / FP4 dequantized on the device,
  exactly, then the quantized arrays dropped; other linear weights cast), norm, mHC, sink,
  position-bias and router-bias tensors float32: the loader's behaviour before FP8 support.

Errors: `ValueError` naming the tensor or file for unknown dtypes, missing shards, corrupt
headers, missing / unexpected tensors, wrong shapes, scales that do not fit their weight.

The parameter tree (`load_params`), weights as `(out, in)`:

    embed (V, hidden), head (V, hidden), norm (hidden,), hc_head {fn (n, n*hidden), base (n,), scale (1,)}
    layers[i]: attn_norm, ffn_norm (hidden,); attn_hc, ffn_hc {fn ((2+n)n, n*hidden), base, scale (3,)}
      attn: wq_a (q_lora, hidden), q_norm (q_lora,), wq_b (H*D, q_lora), wkv (D, hidden), kv_norm (D,),
            wo_a (G*o_lora, H*D/G) (group g = rows g*o_lora ...), wo_b (hidden, G*o_lora), sink (H,)
            compressor (CSA/HCA): wkv, wgate (C, hidden), ape (r, C), norm (D,)   C = 2D (CSA) or D
            indexer (CSA): wkv, wgate (2*dh, hidden), ape (r, 2*dh), norm (dh,), wq_b (nh*dh, q_lora),
                           weights_proj (nh, hidden)
      ffn: gate (E, hidden), bias (E,) (top-k layers) or tid2eid (V, k) int32 (hash layers),
           w13 (E, 2I, hidden) [gate rows | up rows], w2 (E, hidden, I),
           shared_w1, shared_w3 (I, hidden), shared_w2 (hidden, I)
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4_jax.model import parallel
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.names import Part, Source, to_transformers_names, weight_sources
from dsv4_jax.model.quant import FP4_BLOCK, FP8_BLOCK, QuantizedWeight, dequantize, device_scale, expected_scale_shape
from dsv4_jax.model.safetensors_io import ST_NAMES, CheckpointFiles, TensorInfo, read_safetensors
from planner import LayerKind

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
WEIGHTS = ("stored", "dequantized")

__all__ = [
    "DTYPES",
    "WEIGHTS",
    "CheckpointFiles",
    "held_bytes",
    "load_checkpoint",
    "load_params",
    "plan_params",
    "quant_block",
    "read_safetensors",
    "to_transformers_names",
]

# ----------------------------------------------------------------------------- tensor access


class _DictTensors:
    """In-memory tensors with `CheckpointFiles`' interface (names, info, array, release)."""

    def __init__(self, tensors: dict):
        self._t = tensors
        self.tensors = {}
        for name, a in tensors.items():
            a = np.asarray(a)
            if a.dtype not in ST_NAMES:
                raise ValueError(f"tensors: {name!r} has dtype {a.dtype}, not a checkpoint dtype")
            self.tensors[name] = TensorInfo(name, Path("<memory>"), ST_NAMES[a.dtype], a.dtype, a.shape, 0, a.nbytes)

    def names(self):
        return list(self._t)

    def info(self, name):
        return self.tensors[name]

    def array(self, name):
        return np.asarray(self._t[name])

    def read(self, name, index=None):
        a = self.array(name)
        return np.array(a if index is None else a[tuple(index)])

    def release(self, name):
        pass


# ----------------------------------------------------------------------------- parameters


def quant_block(config_json: dict | None) -> tuple[int, int]:
    """The FP8 block of a config.json's `quantization_config` (default 128x128); ValueError for
    a quantization this loader does not read."""
    q = (config_json or {}).get("quantization_config")
    if not q:
        return FP8_BLOCK
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config: expected an object, got {q!r:.100}")
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method: only 'fp8' is read, got {method!r}")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt: only 'e4m3' is read, got {q['fmt']!r}")
    block = q.get("weight_block_size", list(FP8_BLOCK))
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"quantization_config.weight_block_size: expected two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


@dataclass
class _Entry:
    """One model tensor to place: its role (parallel.SPLIT_DIM key), source, logical shape, kind
    ("w" linear weight, "emb" the embedding (never quantized), "f32" norm-like, "int"), its
    quantization format and block."""

    role: str
    source: Source
    shape: tuple[int, ...]
    kind: str
    fmt: str | None = None
    block: tuple[int, int] | None = None


def _check_part(files, part: Part, shape, kind: str, block) -> tuple[str | None, tuple | None]:
    """Validate one part against its logical `shape`; return its (format, block) if quantized."""
    info = files.info(part.name)
    if part.scale is None:
        if kind == "int":
            if info.dtype.kind not in "iu":
                raise ValueError(f"tensors: {part.name!r} has dtype {info.st_dtype}, expected an integer type")
        elif info.st_dtype.startswith("F8") or info.dtype.kind not in "fV" and info.st_dtype != "BF16":
            hint = (
                " without a .scale tensor (FP8 weights need their block scales)"
                if info.st_dtype.startswith("F8")
                else ""
            )
            raise ValueError(f"tensors: {part.name!r} has dtype {info.st_dtype}{hint}, expected a float type")
        if tuple(info.shape) != tuple(shape):
            raise ValueError(f"tensors: {part.name!r} has shape {tuple(info.shape)}, the config needs {tuple(shape)}")
        return None, None
    if kind != "w":
        raise ValueError(f"tensors: {part.name!r} has a scale {part.scale!r}, but only linear weights are quantized")
    sinfo = files.info(part.scale)
    if info.st_dtype == "F8_E4M3":
        fmt, blk, logical = "fp8", tuple(block), tuple(info.shape)
    elif info.st_dtype in ("I8", "U8"):
        fmt, blk = "fp4", FP4_BLOCK
        logical = tuple(info.shape[:-1]) + (2 * info.shape[-1],) if info.shape else ()
    else:
        raise ValueError(
            f"tensors: {part.name!r} has a scale but dtype {info.st_dtype} (expected F8_E4M3, or I8 packed FP4)"
        )
    if logical != tuple(shape):
        what = f" ({fmt}: {tuple(info.shape)} packed)" if fmt == "fp4" else ""
        raise ValueError(f"tensors: {part.name!r} has shape {logical}{what}, the config needs {tuple(shape)}")
    if sinfo.st_dtype not in ("F8_E8M0", "F32"):
        raise ValueError(f"tensors: scale {part.scale!r} has dtype {sinfo.st_dtype}, expected F8_E8M0 or F32")
    want = expected_scale_shape(fmt, logical, blk)
    if tuple(sinfo.shape) != want:
        raise ValueError(
            f"tensors: scale {part.scale!r} has shape {tuple(sinfo.shape)}; {fmt} weight "
            f"{part.name!r} of shape {logical} in {blk[0]}x{blk[1]} blocks needs {want}"
        )
    return fmt, blk


def _check(files, role, src: Source, hf: str, shape, kind: str, block) -> _Entry:
    if src.part is not None:
        fmt, blk = _check_part(files, src.part, shape, kind, block)
        return _Entry(role, src, tuple(shape), kind, fmt, blk)
    E, rows, cols = shape
    if len(src.experts) != E:
        raise ValueError(f"tensors: {hf!r} needs {E} experts, the checkpoint has {len(src.experts)}")
    fmts = set()
    for ps in src.experts:
        per = rows // len(ps)
        for p in ps:
            fmts.add(_check_part(files, p, (per, cols), kind, block))
    if len(fmts) != 1:
        raise ValueError(f"tensors: the experts of {hf!r} mix formats {sorted(map(str, fmts))}")
    fmt, blk = fmts.pop()
    return _Entry(role, src, tuple(shape), kind, fmt, blk)


def _host(a: np.ndarray, kind: str) -> np.ndarray:
    """A copied slice in the dtype the device gets (before any cast)."""
    if kind == "int":
        return np.ascontiguousarray(a, dtype=np.int32)
    if a.dtype == np.float64:
        return np.ascontiguousarray(a, dtype=np.float32)
    if a.dtype == np.int8:  # packed FP4
        return np.ascontiguousarray(a).view(np.uint8)
    return np.ascontiguousarray(device_scale(a))


def _put(read, shape, dtype, shard) -> jax.Array:
    """An array of `shape` on `shard` (a Sharding), each device's block read by `read(index)`.
    shard None: the default device, uncommitted (as `jnp.asarray` places it), so the model's
    programs see one placement for weights, caches and step inputs alike."""
    if shard is None:
        return jax.device_put(read(tuple(slice(None) for _ in shape))).block_until_ready()
    arrays, last = [], (None, None)
    for device, index in shard.addressable_devices_indices_map(tuple(shape)).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        if last[0] != key:
            last = (key, read(index))
        arrays.append(jax.device_put(last[1], device))
    out = jax.make_array_from_single_device_arrays(tuple(shape), shard, arrays, dtype=dtype)
    return out.block_until_ready()


def _stack(pieces_of, shape, dtype, shard, n_experts) -> jax.Array:
    """Experts stacked on each device from per-expert host pieces `pieces_of(e)` (E, rows, cols)."""
    if shard is None:
        parts = [jax.device_put(pieces_of(e)) for e in range(n_experts)]
        return jnp.stack(parts).block_until_ready()
    arrays = []
    for device, index in shard.addressable_devices_indices_map(tuple(shape)).items():
        if any(s != slice(None) for s in index[1:]):
            raise ValueError(f"experts of shape {shape} can only be split on the expert axis, got {index}")
        ids = range(n_experts)[index[0]]
        parts = [jax.device_put(pieces_of(e), device) for e in ids]
        arrays.append(jnp.stack(parts) if len(parts) > 1 else parts[0][None])
        del parts
    return jax.make_array_from_single_device_arrays(tuple(shape), shard, arrays, dtype=dtype).block_until_ready()


@functools.cache
def _dequantizer(fmt, block, dtype, out_sharding):
    def f(data, scale):
        return dequantize(QuantizedWeight(data, scale, fmt, block), dtype)

    return jax.jit(f) if out_sharding is None else jax.jit(f, out_shardings=out_sharding)


def _place(files, e: _Entry, dt, weights: str, mesh, axis):
    """Read, place (and maybe dequantize or cast) one model tensor."""
    quantized = e.fmt is not None
    src = e.source
    parts = [src.part] if src.part else [p for ps in src.experts for p in ps]
    if src.part is not None:
        info = files.info(src.part.name)
        data_shape = tuple(info.shape)
        data = _put(
            lambda idx: _host(files.read(src.part.name, idx), e.kind),
            data_shape,
            _device_dtype(info.dtype, e.kind),
            parallel.sharding(mesh, axis, e.role, data_shape),
        )
        scale = None
        if quantized:
            sinfo = files.info(src.part.scale)
            shard = parallel.sharding(mesh, axis, e.role, sinfo.shape, e.block, e.shape)
            scale = _put(
                lambda idx: _host(files.read(src.part.scale, idx), "w"),
                sinfo.shape,
                _device_dtype(sinfo.dtype, "w"),
                shard,
            )
    else:
        first = src.experts[0]
        i0 = files.info(first[0].name)
        per = [files.info(p.name).shape[0] for p in first]
        data_shape = (len(src.experts), sum(per), i0.shape[1])

        def data_piece(ex):
            return np.concatenate([_host(files.read(p.name), e.kind) for p in src.experts[ex]], axis=0)

        data = _stack(
            data_piece,
            data_shape,
            _device_dtype(i0.dtype, e.kind),
            parallel.sharding(mesh, axis, e.role, data_shape),
            len(src.experts),
        )
        scale = None
        if quantized:
            s0 = files.info(first[0].scale)
            scale_shape = (len(src.experts), sum(files.info(p.scale).shape[0] for p in first), s0.shape[1])

            def scale_piece(ex):
                return np.concatenate([_host(files.read(p.scale), "w") for p in src.experts[ex]], axis=0)

            scale = _stack(
                scale_piece,
                scale_shape,
                _device_dtype(s0.dtype, "w"),
                parallel.sharding(mesh, axis, e.role, scale_shape, e.block, e.shape),
                len(src.experts),
            )
    for p in parts:
        files.release(p.name)
        if p.scale:
            files.release(p.scale)
    if quantized:
        if weights == "stored":
            return QuantizedWeight(data, scale, e.fmt, e.block)
        where = None if mesh is None else data.sharding
        out = _dequantizer(e.fmt, e.block, dt, where)(data, scale)
        del data, scale
        return out.block_until_ready()
    if weights == "dequantized":
        want = dt if e.kind in ("w", "emb") else (jnp.float32 if e.kind == "f32" else None)
        if want is not None and data.dtype != want:
            return _cast(data, want)
    return data


def _cast(a, dtype):
    return a.astype(dtype)


def _device_dtype(dtype: np.dtype, kind: str):
    if kind == "int":
        return np.int32
    if dtype == np.float64:
        return np.float32
    if dtype in (np.dtype(np.int8), np.dtype(ml_dtypes.float8_e8m0fnu)):
        return np.uint8
    return dtype


def load_params(
    cfg: ModelConfig,
    tensors,
    dtype="float32",
    *,
    weights: str = "stored",
    mesh=None,
    axis=None,
    block_size: tuple[int, int] = FP8_BLOCK,
) -> dict:
    """The model's parameter tree (module docstring) from `tensors`: a `CheckpointFiles` or a
    dict of NumPy arrays, in any name style. `dtype`: the compute dtype ("dequantized" weights
    are cast to it). `mesh`, `axis`: split the weights as `dsv4_jax.model.parallel` says.
    `block_size`: the FP8 scale block (the checkpoint's `weight_block_size`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {WEIGHTS}, got {weights!r}")
    files = tensors if isinstance(tensors, CheckpointFiles) else _DictTensors(tensors)
    mesh, axis = parallel.resolve_mesh(mesh, axis)
    if mesh is not None:
        parallel.check_divisible(cfg, mesh, axis)
    tree, tied = plan_params(cfg, files, block_size)
    # Every header is checked: now the bytes, one tensor at a time.
    dt = DTYPES[dtype]
    params = jax.tree.map(
        lambda e: _place(files, e, dt, weights, mesh, axis), tree, is_leaf=lambda x: isinstance(x, _Entry)
    )
    if tied:
        params["head"] = params["embed"]
    for ffn in (lp["ffn"] for lp in params["layers"]):
        if "tid2eid" in ffn:
            t = np.asarray(ffn["tid2eid"])
            if t.min() < 0 or t.max() >= cfg.n_routed_experts:
                raise ValueError(f"tensors: a tid2eid table holds expert ids outside 0..{cfg.n_routed_experts - 1}")
    return params


def plan_params(cfg: ModelConfig, files, block_size: tuple[int, int] = FP8_BLOCK):
    """The parameter tree with an `_Entry` (role, source, logical shape, format) per tensor, every
    name, dtype and shape checked against `cfg` from the headers alone; and whether the head is
    the tied embedding. `files`: anything with `names()` and `info(name)` (`CheckpointFiles`)."""
    sources, _mtp = weight_sources(files.names())
    used: set[str] = set()
    H, D, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    hid, n, E = cfg.hidden_size, cfg.hc_mult, cfg.n_routed_experts
    inter, qr = cfg.moe_intermediate_size, cfg.q_lora_rank

    def get(name, shape, kind="w", role=""):
        if name not in sources:
            raise ValueError(f"tensors: missing {name!r}")
        used.add(name)
        return _check(files, role, sources[name], name, shape, kind, block_size)

    def hc(prefix, rows):
        return {
            "fn": get(prefix + "fn", (rows, n * hid), "f32"),
            "base": get(prefix + "base", (rows,), "f32"),
            "scale": get(prefix + "scale", (3,), "f32"),
        }

    tree = {"embed": get("model.embed_tokens.weight", (cfg.vocab_size, hid), "emb", role="embed")}
    layers = []
    for i, (kind, mtype) in enumerate(zip(cfg.kinds, cfg.mlp_layer_types)):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn = {
            "wq_a": get(a + "q_a_proj.weight", (qr, hid)),
            "q_norm": get(a + "q_a_norm.weight", (qr,), "f32"),
            "wq_b": get(a + "q_b_proj.weight", (H * D, qr), role="attn.wq_b"),
            "wkv": get(a + "kv_proj.weight", (D, hid)),
            "kv_norm": get(a + "kv_norm.weight", (D,), "f32"),
            "wo_a": get(a + "o_a_proj.weight", (G * cfg.o_lora_rank, H * D // G), role="attn.wo_a"),
            "wo_b": get(a + "o_b_proj.weight", (hid, G * cfg.o_lora_rank), role="attn.wo_b"),
            "sink": get(a + "sinks", (H,), "f32", role="attn.sink"),
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
                "ape": get(x + "position_bias", (cfg.compress_rate_csa, 2 * dh), "f32"),
                "norm": get(x + "kv_norm.weight", (dh,), "f32"),
                "wq_b": get(x + "q_b_proj.weight", (nh * dh, qr)),
                "weights_proj": get(x + "scorer.weights_proj.weight", (nh, hid)),
            }
        m = p + "mlp."
        ffn = {
            "gate": get(m + "gate.weight", (E, hid)),
            "w13": get(m + "experts.gate_up_proj", (E, 2 * inter, hid), role="ffn.w13"),
            "w2": get(m + "experts.down_proj", (E, hid, inter), role="ffn.w2"),
            "shared_w1": get(m + "shared_experts.gate_proj.weight", (inter, hid), role="ffn.shared_w1"),
            "shared_w3": get(m + "shared_experts.up_proj.weight", (inter, hid), role="ffn.shared_w3"),
            "shared_w2": get(m + "shared_experts.down_proj.weight", (hid, inter), role="ffn.shared_w2"),
        }
        if mtype == "hash_moe":
            ffn["tid2eid"] = get(m + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "int")
        else:
            ffn["bias"] = get(m + "gate.e_score_correction_bias", (E,), "f32")
        layers.append(
            {
                "attn_norm": get(p + "input_layernorm.weight", (hid,), "f32"),
                "ffn_norm": get(p + "post_attention_layernorm.weight", (hid,), "f32"),
                "attn_hc": hc(p + "attn_hc.", (2 + n) * n),
                "ffn_hc": hc(p + "ffn_hc.", (2 + n) * n),
                "attn": attn,
                "ffn": ffn,
            }
        )
    tree["layers"] = layers
    tree["norm"] = get("model.norm.weight", (hid,), "f32")
    tree["hc_head"] = {
        "fn": get("model.hc_head.hc_fn", (n, n * hid), "f32"),
        "base": get("model.hc_head.hc_base", (n,), "f32"),
        "scale": get("model.hc_head.hc_scale", (1,), "f32"),
    }
    tied = "lm_head.weight" not in sources and cfg.tie_word_embeddings
    if not tied:
        tree["head"] = get("lm_head.weight", (cfg.vocab_size, hid), role="head")
    unused = sorted(set(sources) - used)
    if unused:
        raise ValueError(f"tensors: {len(unused)} tensors the config does not use, e.g. {unused[:3]}")
    return tree, tied


def held_bytes(tree, files, n: int) -> tuple[int, int]:
    """(bytes one device holds, all bytes) of a `plan_params` tree split over n devices as
    `dsv4_jax.model.parallel` says, from the headers alone (e.g. the V4-Flash figure)."""
    held = total = 0
    for e in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, _Entry)):
        parts = [e.source.part] if e.source.part else [p for ps in e.source.experts for p in ps]
        data = sum(files.info(p.name).nbytes for p in parts)
        split = parallel.spec(e.role, e.shape, n, "x") != jax.sharding.PartitionSpec() if n > 1 else False
        held += data // n if split else data
        total += data
        if e.fmt is not None:
            scale = sum(files.info(p.scale).nbytes for p in parts)
            sshape = tuple(files.info(parts[0].scale).shape)
            if e.source.experts:
                sshape = (len(e.source.experts),) + sshape
            s_split = n > 1 and parallel.spec(e.role, sshape, n, "x", e.block, e.shape) != jax.sharding.PartitionSpec()
            held += scale // n if s_split else scale
            total += scale
    return held, total


def load_checkpoint(
    path, dtype="float32", *, weights: str = "stored", mesh=None, axis=None
) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a checkpoint directory: config.json + safetensors (module docstring)."""
    cfg = ModelConfig.from_checkpoint(path)
    block = quant_block(json.loads((Path(path) / "config.json").read_text()))
    files = CheckpointFiles(path)
    try:
        return cfg, load_params(cfg, files, dtype, weights=weights, mesh=mesh, axis=axis, block_size=block)
    finally:
        files.close()
