"""Tiny random DeepSeek-V4 checkpoints, written deterministically from a seed.

    python -m tools.tiny_checkpoint --out DIR [--seed 0] [--names hf|deepseek] [--dtype float32|bfloat16]

writes `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` and
`generation_config.json` into DIR, loadable with `DeepseekV4ForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)`. Same arguments -> byte-identical files.

* `names="hf"`: transformers' parameter names and config fields (`layer_types`, `mlp_layer_types`,
  `rope_parameters`).
* `names="deepseek"`: DeepSeek's original parameter names (`layers.0.attn.wq_a.weight`,
  per-expert `w1/w2/w3`, ...) and the published config's fields (`compress_ratios` with the MTP
  slot, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`); transformers converts both on load
  to the very same model.

Every tensor is drawn from its own stream, seeded by `(seed, crc32(transformers name))`, so the
two name styles hold identical values and adding a parameter never shifts the others. Scales
keep activations O(1) through the layers (linear weights ~ N(0, 1/fan_in)); sinks, position
biases (`ape`), norm weights, mHC biases/scales, router correction biases and the hash-routing
table `tid2eid` get non-trivial random values.

Writing needs numpy, safetensors and tokenizers (and ml_dtypes for bfloat16); not torch, not
transformers. The files are byte-identical to what the earlier torch-based writer produced.
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
from pathlib import Path

import numpy as np

from planner.contract import preset

# Layer kinds in the order of the preset: every kind at least twice, SWA first as in V4-Flash.
TINY_COMPRESS_RATIOS = (0, 0, 4, 128, 4, 128)
TINY_NUM_HASH_LAYERS = 3
_LAYER_TYPE_OF_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")  # ids 0, 1, 2
NAME_STYLES = ("hf", "deepseek")
DTYPES = ("float32", "bfloat16")


def tiny_config(**overrides) -> dict:
    """The tiny preset in transformers' field names (a plain dict, `config.json` content):
    `planner.contract.PRESETS["tiny"]`, the one preset table.

    Real head geometry (head_dim 512 with 64 RoPE dims, index_head_dim 128, hc_mult 4, Sinkhorn 20
    iterations, YaRN on the compressed layers) at toy width: hidden 64, 8 query heads, 16 indexer
    heads (fewer make top-k ties likely), index_topk 8, sliding_window 8, vocab 512, 8 experts.
    Keyword overrides replace top-level fields (`compress_rates={...}` for other ratios);
    `compress_ratios=(...)` (V4.0's 0 / 4 / 128 per layer) and `num_hash_layers=n` are accepted as
    shortcuts for `layer_types` / `mlp_layer_types`.
    """
    ratios = tuple(overrides.pop("compress_ratios", TINY_COMPRESS_RATIOS))
    n_hash = int(overrides.pop("num_hash_layers", TINY_NUM_HASH_LAYERS))
    for r in ratios:
        if r not in _LAYER_TYPE_OF_RATIO:
            raise ValueError(f"compress_ratios: each entry must be 0, 4 or 128 (V4.0's kinds), got {r}")
    n = len(ratios)
    if not 0 <= n_hash <= n:
        raise ValueError(f"num_hash_layers: must be in 0..{n}, got {n_hash}")
    cfg = preset("tiny")
    cfg["num_hidden_layers"] = n
    cfg["layer_types"] = [_LAYER_TYPE_OF_RATIO[r] for r in ratios]
    cfg["mlp_layer_types"] = ["hash_moe"] * n_hash + ["moe"] * (n - n_hash)
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"tiny_config: unknown fields {sorted(unknown)}")
    cfg.update(overrides)
    return cfg


def _ratios(cfg: dict) -> list[int]:
    rates = cfg["compress_rates"]
    return [0 if t == "sliding_attention" else int(rates[t]) for t in cfg["layer_types"]]


def deepseek_config(cfg: dict) -> dict:
    """`cfg` (transformers' fields) rewritten in the field names of DeepSeek's published config.

    `compress_ratios` gets the trailing MTP slot (0) like the real file; transformers drops it.
    """
    out = {
        k: v
        for k, v in cfg.items()
        if k
        not in ("layer_types", "mlp_layer_types", "rope_parameters", "compress_rates", "partial_rotary_factor", "dtype")
    }
    comp = cfg["rope_parameters"]["compress"]
    n_hash = sum(t == "hash_moe" for t in cfg["mlp_layer_types"])
    if cfg["mlp_layer_types"][:n_hash] != ["hash_moe"] * n_hash:
        raise ValueError(f"cfg: DeepSeek's num_hash_layers needs hash_moe layers first, got {cfg['mlp_layer_types']}")
    out["compress_ratios"] = _ratios(cfg) + [0] * int(cfg["num_nextn_predict_layers"])
    out["num_hash_layers"] = n_hash
    out["qk_rope_head_dim"] = int(round(cfg["head_dim"] * cfg["partial_rotary_factor"]))
    out["rope_scaling"] = {
        "type": "yarn",
        "factor": comp["factor"],
        "original_max_position_embeddings": comp["original_max_position_embeddings"],
        "beta_fast": comp["beta_fast"],
        "beta_slow": comp["beta_slow"],
    }
    out["topk_method"] = "noaux_tc"
    out["torch_dtype"] = cfg["dtype"]
    return out


def parameter_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of `DeepseekV4ForCausalLM.state_dict()` (transformers' names) and its shape."""
    hid, V, H, D = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["head_dim"]
    qr, G, orank = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    nh, E, inter, k = cfg["hc_mult"], cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    rates = cfg["compress_rates"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, hid)}
    for i, (ltype, mtype) in enumerate(zip(cfg["layer_types"], cfg["mlp_layer_types"])):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes.update(
            {
                a + "q_a_proj.weight": (qr, hid),
                a + "q_a_norm.weight": (qr,),
                a + "q_b_proj.weight": (H * D, qr),
                a + "kv_proj.weight": (D, hid),
                a + "kv_norm.weight": (D,),
                a + "o_a_proj.weight": (G * orank, H * D // G),
                a + "o_b_proj.weight": (hid, G * orank),
                a + "sinks": (H,),
            }
        )
        if ltype != "sliding_attention":
            r = int(rates[ltype])
            width = 2 * D if ltype == "compressed_sparse_attention" else D  # CSA: two overlapped series
            c = a + "compressor."
            shapes.update(
                {
                    c + "kv_proj.weight": (width, hid),
                    c + "gate_proj.weight": (width, hid),
                    c + "position_bias": (r, width),
                    c + "kv_norm.weight": (D,),
                }
            )
            if ltype == "compressed_sparse_attention":
                x = c + "indexer."
                shapes.update(
                    {
                        x + "kv_proj.weight": (2 * idim, hid),
                        x + "gate_proj.weight": (2 * idim, hid),
                        x + "position_bias": (r, 2 * idim),
                        x + "kv_norm.weight": (idim,),
                        x + "q_b_proj.weight": (ih * idim, qr),
                        x + "scorer.weights_proj.weight": (ih, hid),
                    }
                )
        m = p + "mlp."
        shapes[m + "gate.weight"] = (E, hid)
        if mtype == "hash_moe":
            shapes[m + "gate.tid2eid"] = (V, k)
        else:
            shapes[m + "gate.e_score_correction_bias"] = (E,)
        shapes.update(
            {
                m + "experts.gate_up_proj": (E, 2 * inter, hid),
                m + "experts.down_proj": (E, hid, inter),
                m + "shared_experts.gate_proj.weight": (inter, hid),
                m + "shared_experts.up_proj.weight": (inter, hid),
                m + "shared_experts.down_proj.weight": (hid, inter),
                p + "input_layernorm.weight": (hid,),
                p + "post_attention_layernorm.weight": (hid,),
            }
        )
        for hc in ("attn_hc", "ffn_hc"):
            shapes.update(
                {
                    p + f"{hc}.fn": ((2 + nh) * nh, nh * hid),
                    p + f"{hc}.base": ((2 + nh) * nh,),
                    p + f"{hc}.scale": (3,),
                }
            )
    shapes.update(
        {
            "model.norm.weight": (hid,),
            "model.hc_head.hc_fn": (nh, nh * hid),
            "model.hc_head.hc_base": (nh,),
            "model.hc_head.hc_scale": (1,),
            "lm_head.weight": (V, hid),
        }
    )
    return shapes


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), zlib.crc32(name.encode())]))


def _init(name: str, shape: tuple[int, ...], cfg: dict, seed: int) -> np.ndarray:
    """One tensor's random value; the rule depends on what the tensor does."""
    g = _rng(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # distinct experts per token id, as a frozen hash table
        E = cfg["n_routed_experts"]
        return np.stack([g.permutation(E)[: shape[1]] for _ in range(shape[0])]).astype(np.int64)
    if name.endswith("norm.weight"):  # every RMSNorm weight
        return (1.0 + 0.1 * g.standard_normal(shape)).astype(np.float32)
    if leaf == "sinks":
        return g.normal(0.0, 1.0, shape).astype(np.float32)
    if leaf == "position_bias":
        return g.normal(0.0, 1.0, shape).astype(np.float32)
    if leaf in ("base", "hc_base"):
        return g.normal(0.0, 0.5, shape).astype(np.float32)
    if leaf in ("scale", "hc_scale"):
        return g.uniform(0.5, 1.5, shape).astype(np.float32)
    if leaf == "e_score_correction_bias":
        return g.normal(0.0, 0.1, shape).astype(np.float32)
    if name == "model.embed_tokens.weight":
        return g.standard_normal(shape).astype(np.float32)
    # Everything else maps its last dim (fan-in) linearly: unit-variance outputs for unit inputs.
    return (g.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def init_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint in transformers' names (float32, tid2eid int64)."""
    return {name: _init(name, shape, cfg, seed) for name, shape in parameter_shapes(cfg).items()}


_DEEPSEEK_LEAVES = [  # transformers suffix -> DeepSeek suffix, inside model.layers.{i}.
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
]
_DEEPSEEK_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
    "lm_head.weight": "head.weight",
}


def to_deepseek_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename (and split the packed experts of) a transformers-named state dict into DeepSeek's
    original names: the inverse of transformers' `conversion_mapping["deepseek_v4"]`."""
    out: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        if name in _DEEPSEEK_TOP:
            out[_DEEPSEEK_TOP[name]] = t
            continue
        if not name.startswith("model.layers."):
            raise ValueError(f"tensors: no DeepSeek name for {name!r}")
        i, rest = name[len("model.layers.") :].split(".", 1)
        p = f"layers.{i}."
        if rest == "mlp.experts.gate_up_proj":  # (E, 2I, hidden): gate rows then up rows
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[p + f"ffn.experts.{e}.w1.weight"] = np.ascontiguousarray(t[e, :inter])
                out[p + f"ffn.experts.{e}.w3.weight"] = np.ascontiguousarray(t[e, inter:])
            continue
        if rest == "mlp.experts.down_proj":  # (E, hidden, I)
            for e in range(t.shape[0]):
                out[p + f"ffn.experts.{e}.w2.weight"] = np.ascontiguousarray(t[e])
            continue
        for hf_leaf, ds_leaf in _DEEPSEEK_LEAVES:
            if rest == hf_leaf:
                out[p + ds_leaf] = t
                break
        else:
            raise ValueError(f"tensors: no DeepSeek name for {name!r}")
    return out


# ----------------------------------------------------------------------------- tokenizer

_NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Ines",
    "Jamal",
    "Kira",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Pablo",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Umar",
    "Vera",
    "Wen",
    "Yusuf",
    "Zoe",
]
_ITEMS = [
    ("apple", "apples"),
    ("marble", "marbles"),
    ("book", "books"),
    ("pencil", "pencils"),
    ("cookie", "cookies"),
    ("sticker", "stickers"),
    ("shell", "shells"),
    ("card", "cards"),
    ("egg", "eggs"),
    ("flower", "flowers"),
    ("coin", "coins"),
    ("box", "boxes"),
]


def _problem(rng: random.Random) -> str:
    """One arithmetic word problem with a worked answer in the '#### N' style."""
    a, b = rng.sample(_NAMES, 2)
    one, many = rng.choice(_ITEMS)
    x, y, z = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 9)
    kind = rng.randrange(6)
    if kind == 0:
        return (
            f"{a} has {x} {many}. {b} gives {a} {y} more {many}. How many {many} does {a} have now?\n"
            f"{a} has {x} + {y} = {x + y} {many}.\n#### {x + y}"
        )
    if kind == 1:
        x = x + y
        return (
            f"{a} had {x} {many} and gave {y} of them to {b}. How many {many} are left?\n"
            f"{x} - {y} = {x - y}, so {x - y} {many} are left.\n#### {x - y}"
        )
    if kind == 2:
        return (
            f"Each box holds {z} {many}. {a} buys {y} boxes. How many {many} does {a} buy?\n"
            f"{y} * {z} = {y * z}.\n#### {y * z}"
        )
    if kind == 3:
        return (
            f"{a} shares {y * z} {many} equally among {z} friends. How many {many} does each friend get?\n"
            f"{y * z} / {z} = {y}.\n#### {y}"
        )
    if kind == 4:
        price = rng.randint(1, 12)
        return (
            f"A {one} costs ${price}. {a} buys {y} of them and pays with ${price * y + x}. "
            f"How much change does {a} get?\nThe {many} cost {y} * {price} = ${price * y}. "
            f"The change is {price * y + x} - {price * y} = ${x}.\n#### {x}"
        )
    w = rng.randint(2, 5)
    total = x + w * y
    return (
        f"{a} reads {x} pages on Monday and {y} pages on each of the next {w} days. "
        f"How many pages does {a} read in total?\n{x} + {w} * {y} = {x} + {w * y} = {total}.\n#### {total}"
    )


def corpus(num_problems: int = 600, seed: int = 1234) -> list[str]:
    """The built-in training text of the tiny tokenizer: composed arithmetic word problems."""
    rng = random.Random(seed)
    return [_problem(rng) for _ in range(num_problems)]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus()`; adds `<bos>` in front.

    Byte-level: every string (any Unicode) encodes and decodes back unchanged.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


# ----------------------------------------------------------------------------- writer


def _bfloat16():
    try:
        import ml_dtypes
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "dtype='bfloat16': writing bfloat16 tensors needs ml_dtypes (pip install ml_dtypes; jax installs it)"
        ) from None
    return ml_dtypes.bfloat16


def dump_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_tokenizer_files(out: Path, cfg: dict, tokenizer: bool = True) -> None:
    """tokenizer.json (unless `tokenizer` is False), tokenizer_config.json and generation_config.json
    for a checkpoint of config `cfg` (transformers' names)."""
    if tokenizer:
        tok = build_tokenizer(cfg["vocab_size"])
        (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    dump_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": SPECIAL_TOKENS[0],
            "eos_token": SPECIAL_TOKENS[1],
            "pad_token": SPECIAL_TOKENS[2],
            "clean_up_tokenization_spaces": False,
            "model_max_length": cfg["max_position_embeddings"],
        },
    )
    dump_json(
        out / "generation_config.json",
        {
            "bos_token_id": cfg["bos_token_id"],
            "eos_token_id": cfg["eos_token_id"],
            "pad_token_id": cfg["pad_token_id"],
            "do_sample": False,
        },
    )


def write_tiny_checkpoint(out_dir, seed: int = 0, names: str = "hf", dtype: str = "float32", config=None) -> Path:
    """Write a tiny random DeepSeek-V4 checkpoint directory; returns its path.

    Args:
      out_dir: directory to create or overwrite files in.
      seed: int, the only source of randomness of the weights.
      names: "hf" (transformers' names and config fields) or "deepseek" (DeepSeek's originals).
      dtype: "float32" or "bfloat16" for floating tensors (tid2eid stays int64).
      config: optional dict from `tiny_config(...)`; default `tiny_config()`.
    """
    from safetensors.numpy import save_file

    if names not in NAME_STYLES:
        raise ValueError(f"names: expected one of {NAME_STYLES}, got {names!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    cfg = dict(tiny_config() if config is None else config)
    cfg["dtype"] = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tensors = init_tensors(cfg, seed)
    if names == "deepseek":
        tensors = to_deepseek_names(tensors)
    if dtype == "bfloat16":  # round to nearest even, as torch's .to(torch.bfloat16) does
        bf16 = _bfloat16()
        tensors = {k: v if v.dtype.kind in "iu" else v.astype(bf16) for k, v in tensors.items()}
    # safetensors lays the data out by dtype alignment, then name; "format": "pt" is what
    # transformers' loader expects of a checkpoint's metadata.
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})

    dump_json(out / "config.json", cfg if names == "hf" else deepseek_config(cfg))
    write_tokenizer_files(out, cfg)
    return out


# ----------------------------------------------------------------------------- DeepSeek-V4.1

# The tiny Engram: one layer (before the replay cut), 2-grams and 3-grams, 2 hash heads each,
# 32-dim rows, buckets from primes above 61 (`dsv4_jax.model.engram`).
TINY_V41_ENGRAM = dict(
    engram_layer_ids=[1],
    engram_vocab_size=61,
    engram_max_ngram_size=3,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_pad_id=2,
)


def tiny_v41_config(engram: bool = True, **overrides) -> dict:
    """A tiny DeepSeek-V4.1 text config in transformers' fields (`DeepseekV41TextConfig`):
    `planner.contract.V41_PRESETS["V4.1-tiny"]` (7 layers of every role: window, a ratio-2 KV
    source and its reuse, the ratio-1 cut and candidate source, a reuse, a Reindex candidate
    consumer and its reuse; head_dim 512 / RoPE 64 / index_head_dim 128, 16 indexer heads,
    window 16, index_topk 8, candidate blocks 4 x 4), plus, with `engram`, a tiny Engram at
    layer 1 whose compressed vocabulary is the tiny tokenizer's (computed here). Keyword
    overrides replace fields."""
    cfg = preset("V4.1-tiny")
    cfg["bos_token_id"] = 0
    if engram:
        cfg.update(TINY_V41_ENGRAM)
    unknown = (
        set(overrides) - set(cfg) - set(TINY_V41_ENGRAM) - {"engram_num_embeddings", "engram_compressed_vocab_size"}
    )
    if unknown:
        raise ValueError(f"tiny_v41_config: unknown fields {sorted(unknown)}")
    cfg.update(overrides)
    if cfg.get("engram_layer_ids"):
        from types import SimpleNamespace

        from dsv4_jax.model import engram as eg

        ns = SimpleNamespace(**{**TINY_V41_ENGRAM, **{k: v for k, v in cfg.items() if k.startswith("engram_")}})
        cfg.setdefault("engram_num_embeddings", eg.table_rows(ns))
        if "engram_compressed_vocab_size" not in overrides:
            import tempfile

            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / "tokenizer.json"
                path.write_text(build_tokenizer(cfg["vocab_size"]).to_str())
                cfg["engram_compressed_vocab_size"] = eg.compressed_token_map(path)[1]
    else:
        cfg["engram_layer_ids"] = []
    return cfg


def v41_parameter_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of transformers' `DeepseekV41ForCausalLM.state_dict()` and its shape."""
    from planner.schedule import Schedule

    sched = Schedule.from_config(cfg)
    hid, V, H, D = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["head_dim"]
    qr, G, orank = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    nh, E, inter = cfg["hc_mult"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    engram = list(cfg.get("engram_layer_ids") or [])
    shapes: dict[str, tuple[int, ...]] = {"model.embed.weight": (V, hid)}
    for role in sched:
        p = f"model.layers.{role.layer_id}."
        a = p + "attn."
        shapes.update(
            {
                a + "wq_a.weight": (qr, hid),
                a + "q_norm.weight": (qr,),
                a + "wq_b.weight": (H * D, qr),
                a + "wkv.weight": (D, hid),
                a + "kv_norm.weight": (D,),
                a + "wo_a.weight": (G * orank, H * D // G),
                a + "wo_b.weight": (hid, G * orank),
                a + "attn_sink": (H,),
            }
        )
        if role.is_kv_source:
            shapes[a + "compressor.wkv.weight"] = (D, hid)
            if role.compress_ratio > 1:
                shapes[a + "compressor.wgate.weight"] = (D, hid)
            shapes[a + "compressor.norm.weight"] = (D,)
        if role.is_index_source:
            shapes[a + "indexer.wq_b.weight"] = (ih * idim, qr)
            shapes[a + "indexer.weights_proj.weight"] = (ih, hid)
            if role.is_kv_source:
                shapes[a + "indexer.wk.weight"] = (idim, D)
                shapes[a + "indexer.k_norm.weight"] = (idim,)
        m = p + "ffn."
        shapes.update({m + "gate.weight": (E, hid), m + "gate.bias": (E,), m + "gate.bias_vl": (E,)})
        for e in range(E):
            shapes.update(
                {
                    m + f"experts.{e}.w1.weight": (inter, hid),
                    m + f"experts.{e}.w2.weight": (hid, inter),
                    m + f"experts.{e}.w3.weight": (inter, hid),
                }
            )
        shapes.update(
            {
                m + "shared_experts.w1.weight": (inter, hid),
                m + "shared_experts.w2.weight": (hid, inter),
                m + "shared_experts.w3.weight": (inter, hid),
                p + "attn_norm.weight": (hid,),
                p + "ffn_norm.weight": (hid,),
            }
        )
        for site in ("attn", "ffn"):
            shapes.update(
                {
                    p + f"hc_{site}_fn": ((2 + nh) * nh, nh * hid),
                    p + f"hc_{site}_base": ((2 + nh) * nh,),
                    p + f"hc_{site}_scale": (3,),
                }
            )
        if role.layer_id in engram:
            k = engram.index(role.layer_id)
            rows, edim = cfg["engram_num_embeddings"][k], cfg["engram_head_dim"]
            cols = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
            shapes.update(
                {
                    p + "engram.embed.weight": (rows, edim),
                    p + "engram.embed.scale": (rows, edim // 32),
                    p + "engram.wkv.weight": (hid * (nh + 1), cols * edim),
                    p + "engram.q_weight": (nh, hid),
                    p + "engram.k_weight": (nh, hid),
                }
            )
    shapes.update({"model.norm.weight": (hid,), "lm_head.weight": (V, hid)})
    return shapes


def _init_v41(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    g = _rng(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * g.standard_normal(shape)).astype(np.float32)
    if leaf in ("attn_sink",):
        return g.normal(0.0, 1.0, shape).astype(np.float32)
    if leaf.endswith("_base"):
        return g.normal(0.0, 0.5, shape).astype(np.float32)
    if leaf.endswith("_scale") and leaf.startswith("hc_"):
        return g.uniform(0.5, 1.5, shape).astype(np.float32)
    if leaf in ("bias", "bias_vl"):
        return g.normal(0.0, 0.1, shape).astype(np.float32)
    if leaf in ("q_weight", "k_weight"):
        return (1.0 + 0.2 * g.standard_normal(shape)).astype(np.float32)
    if name.endswith("engram.embed.scale"):
        return np.ones(shape, np.float32)
    if name in ("model.embed.weight",) or name.endswith("engram.embed.weight"):
        return g.standard_normal(shape).astype(np.float32)
    return (g.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def init_v41_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """All tensors of a V4.1 checkpoint in transformers' names, float32, each from its own stream."""
    return {name: _init_v41(name, shape, seed) for name, shape in v41_parameter_shapes(cfg).items()}


def v41_composite_config(cfg: dict) -> dict:
    """The config.json `DeepseekV41ForCausalLM.save_pretrained` writes: `model_type` "deepseek_v41",
    the text fields under `text_config` (model_type "deepseek_v41_text")."""
    text = {k: v for k, v in cfg.items() if k != "architectures"}
    text["model_type"] = "deepseek_v41_text"
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "vision_config": None,
        "tie_word_embeddings": False,
        "dtype": cfg.get("dtype", "float32"),
    }


def write_tiny_v41_checkpoint(out_dir, seed: int = 0, fmt: str = "hf", config=None, engram: bool = True) -> Path:
    """Write a tiny random DeepSeek-V4.1 checkpoint directory in transformers' format (its names
    and composite config.json, float32); returns its path. The official release's format (FP8
    linears on the 32x32 grid, FP4 experts, an FP8 Engram table) is
    `tools.official_checkpoint.write_official_v41_checkpoint` (`python -m tools.official_checkpoint
    --model v4.1`), which builds on this module. config: `tiny_v41_config(...)`."""
    if fmt != "hf":
        hint = (
            " (the official format: tools.official_checkpoint.write_official_v41_checkpoint)"
            if fmt == "official"
            else ""
        )
        raise ValueError(f"fmt: this writer writes 'hf', got {fmt!r}{hint}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    cfg = dict(tiny_v41_config(engram=engram) if config is None else config)
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        dict(sorted(init_v41_tensors(cfg, seed).items())), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    dump_json(out / "config.json", v41_composite_config(cfg))
    write_tokenizer_files(out, {**cfg, "bos_token_id": cfg.get("bos_token_id", 0), "pad_token_id": 2})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--names", choices=NAME_STYLES, default="hf")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--model", choices=("v4", "v4.1"), default="v4", help="DeepSeek-V4 (default) or V4.1")
    ap.add_argument("--no-engram", action="store_true", help="V4.1: no Engram layer")
    args = ap.parse_args(argv)
    if args.model == "v4.1":
        path = write_tiny_v41_checkpoint(args.out, seed=args.seed, engram=not args.no_engram)
        print(path)
        return
    path = write_tiny_checkpoint(args.out, seed=args.seed, names=args.names, dtype=args.dtype)
    print(path)


if __name__ == "__main__":
    main()
