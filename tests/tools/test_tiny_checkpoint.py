"""Tiny random DeepSeek-V4 checkpoints: determinism, both name styles, loadability, tokenizer.

The writer (`tools.tiny_checkpoint`) needs no torch: the file-level tests below read the
safetensors back with NumPy; the tests that load the checkpoint into transformers' model need
torch and transformers and skip without them.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools.tiny_checkpoint import (
    TINY_COMPRESS_RATIOS,
    corpus,
    deepseek_config,
    init_tensors,
    parameter_shapes,
    tiny_config,
    to_deepseek_names,
    write_tiny_checkpoint,
)

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_torch = pytest.mark.skipif(transformers is None, reason="needs torch and transformers (loads the model)")
ROOT = Path(__file__).resolve().parents[2]

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints


@pytest.fixture(scope="module")
def model(ckpt):
    if transformers is None:
        pytest.skip("needs torch and transformers (loads the model)")
    return transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt["hf"]).eval()


def test_same_seed_same_bytes_other_seed_other_weights(ckpt, tmp_path):
    again = write_tiny_checkpoint(tmp_path / "again", seed=0, names="hf")
    for f in FILES:
        assert (again / f).read_bytes() == (ckpt["hf"] / f).read_bytes(), f
    other = write_tiny_checkpoint(tmp_path / "other", seed=1, names="hf")
    assert (other / "model.safetensors").read_bytes() != (ckpt["hf"] / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (ckpt["hf"] / "tokenizer.json").read_bytes()


def test_command_line_writes_the_same_files(ckpt, tmp_path):
    out = tmp_path / "cli"
    subprocess.run(
        [sys.executable, "-m", "tools.tiny_checkpoint", "--out", str(out), "--names", "deepseek"],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    for f in FILES:
        assert (out / f).read_bytes() == (ckpt["deepseek"] / f).read_bytes(), f


@needs_torch
def test_both_name_styles_load_to_identical_models(ckpt):
    loaded = {}
    for style, path in ckpt.items():
        m, info = transformers.DeepseekV4ForCausalLM.from_pretrained(path, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], (style, info)
        loaded[style] = m
    hf, ds = loaded["hf"], loaded["deepseek"]
    for field in (
        "layer_types",
        "mlp_layer_types",
        "partial_rotary_factor",
        "qk_rope_head_dim",
        "sliding_window",
        "compress_rates",
        "index_topk",
        "index_n_heads",
    ):
        assert getattr(hf.config, field) == getattr(ds.config, field), field
    s_hf, s_ds = hf.state_dict(), ds.state_dict()
    assert s_hf.keys() == s_ds.keys()
    for k in s_hf:
        assert torch.equal(s_hf[k], s_ds[k]), k
    # The YaRN ("compress") and plain ("main") RoPE tables agree too.
    for name, buf in hf.model.rotary_emb.named_buffers():
        assert torch.equal(buf, dict(ds.model.rotary_emb.named_buffers())[name]), name
    # The file holds the values we generated, under transformers' names.
    ref = init_tensors(tiny_config(), seed=0)
    assert s_hf.keys() == ref.keys()
    for k in (
        "model.layers.2.self_attn.compressor.indexer.position_bias",
        "model.layers.0.mlp.gate.tid2eid",
        "model.layers.3.mlp.experts.gate_up_proj",
    ):
        np.testing.assert_array_equal(s_hf[k].numpy(), ref[k])


def test_config_has_every_layer_kind_twice_and_sparse_settings():
    cfg = tiny_config()
    assert set(parameter_shapes(cfg)) == set(init_tensors(cfg))
    for kind in ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"):
        assert cfg["layer_types"].count(kind) >= 2, kind
    assert cfg["index_n_heads"] >= 16 and cfg["index_topk"] < 64 and cfg["sliding_window"] <= 16
    assert "hash_moe" in cfg["mlp_layer_types"] and "moe" in cfg["mlp_layer_types"]
    ds = deepseek_config(cfg)
    assert ds["compress_ratios"] == list(TINY_COMPRESS_RATIOS) + [0]  # trailing MTP slot, as published
    assert ds["num_hash_layers"] == cfg["mlp_layer_types"].count("hash_moe") and ds["qk_rope_head_dim"] == 64


def test_special_tensors_are_non_trivial(model):
    cfg = model.config
    sd = model.state_dict()
    for i, ltype in enumerate(cfg.layer_types):
        assert sd[f"model.layers.{i}.self_attn.sinks"].std() > 0.5
        if ltype != "sliding_attention":
            assert sd[f"model.layers.{i}.self_attn.compressor.position_bias"].std() > 0.5
        if cfg.mlp_layer_types[i] == "hash_moe":
            t = sd[f"model.layers.{i}.mlp.gate.tid2eid"]
            assert t.dtype == torch.int64 and t.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
            assert (t[:, 0] != t[:, 1]).all() and set(t.flatten().tolist()) == set(range(cfg.n_routed_experts))
        else:
            assert sd[f"model.layers.{i}.mlp.gate.e_score_correction_bias"].abs().max() > 0


@needs_torch
def test_fp32_forward_has_finite_varied_logits(ckpt, model):
    tok = transformers.AutoTokenizer.from_pretrained(ckpt["hf"])
    ids = tok("\n\n".join(corpus()[:3]), return_tensors="pt").input_ids
    assert ids.shape[1] > 64  # long enough for CSA entries to exist
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 10
    assert logits.argmax(-1).unique().numel() > ids.shape[1] // 4


@needs_torch
def test_greedy_generate(ckpt, model):
    tok = transformers.AutoTokenizer.from_pretrained(ckpt["hf"])
    ids = tok(corpus()[7], return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    new = out[0, ids.shape[1] :]
    assert new.shape[0] == 8 and new.unique().numel() > 1
    assert torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False))


@needs_torch
def test_tokenizer_round_trips_any_text(ckpt):
    tok = transformers.AutoTokenizer.from_pretrained(ckpt["deepseek"])
    assert len(tok) <= tiny_config()["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    for text in [corpus()[0], "  two  spaces\tand a tab\n\nnew lines ", "Ünïcödé ∑ 数学 🧮 -0.5e+3 ####", ""]:
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Trained on word problems: their words merge into few tokens.
    text = "How many apples does Ava have now?"
    assert len(tok(text).input_ids) <= len(text) // 3


@needs_torch
def test_bfloat16_checkpoint_holds_rounded_weights(ckpt, tmp_path):
    path = write_tiny_checkpoint(tmp_path / "bf16", dtype="bfloat16")
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt["hf"]).state_dict()
    for k, v in m.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(v, ref[k].to(torch.bfloat16).to(torch.float32)), k


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"names": "gguf"}, "names"),
        ({"dtype": "float16"}, "dtype"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_arguments_raise(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        write_tiny_checkpoint(tmp_path / "x", **kwargs)


def test_bad_preset_overrides_raise():
    with pytest.raises(ValueError, match="compress_ratios"):
        tiny_config(compress_ratios=(0, 8))
    with pytest.raises(ValueError, match="unknown"):
        tiny_config(hidden_sise=32)


@needs_torch
def test_package_import_is_light():
    # dsv4_torch itself imports torch; the hf subpackage must not pull in transformers
    code = "import sys, dsv4_torch.hf; print('transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.split() == ["False"]


# ----------------------------------------------------------------------------- torch-free checks


def _read_safetensors(path: Path):
    """(metadata, {name: array}) of a safetensors file, parsed here with NumPy alone.

    bfloat16 tensors come back as their raw uint16 bit patterns (NumPy has no bfloat16)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__")
    types = {"F32": np.float32, "BF16": np.uint16, "I64": np.int64}
    body = data[8 + n :]
    out, end = {}, 0
    for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        a, b = h["data_offsets"]
        assert a == end, f"{name}: data not packed ({a} != {end})"  # no gaps, no overlaps
        out[name] = (h["dtype"], np.frombuffer(body[a:b], types[h["dtype"]]).reshape(h["shape"]))
        end = b
    assert end == len(body)
    return meta, out


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (finite inputs)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("names", ["hf", "deepseek"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_file_holds_init_tensors(tmp_path, names, dtype):
    """The safetensors file holds `init_tensors` exactly (bf16: rounded to nearest even), under
    the chosen names, with the metadata transformers expects; checked without torch."""
    path = write_tiny_checkpoint(tmp_path / "ckpt", seed=0, names=names, dtype=dtype)
    meta, got = _read_safetensors(path / "model.safetensors")
    assert meta == {"format": "pt"}
    want = init_tensors(tiny_config(), seed=0)
    if names == "deepseek":
        want = to_deepseek_names(want)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        st_dtype, g = got[name]
        assert g.shape == w.shape, name
        if w.dtype == np.int64:
            assert st_dtype == "I64" and np.array_equal(g, w), name
        elif dtype == "float32":
            assert st_dtype == "F32" and np.array_equal(g.view(np.uint32), w.view(np.uint32)), name
        else:
            assert st_dtype == "BF16" and np.array_equal(g, _bf16_bits(w)), name


def test_writer_does_not_import_torch(tmp_path):
    code = (
        "import sys; from tools.tiny_checkpoint import write_tiny_checkpoint; "
        f"write_tiny_checkpoint({str(tmp_path / 'c')!r}, names='deepseek', dtype='bfloat16'); "
        "print(sorted(m for m in ('torch', 'transformers', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.split() == ["[]"]
