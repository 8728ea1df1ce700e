"""The JAX model on the official release format (issue 14): the loader, FP8 / FP4 weights on the
device, the mesh split, text in and out, GSM8K on such a directory.

The fixture is the tiny random checkpoint turned into the official format by
`tools.official_checkpoint` (DeepSeek names, FP8 128x128 E8M0 blocks, FP4 experts, mtp.0.*, two
shards + index). Quantizing changes the model, so every comparison is between models loaded
from that directory: JAX with FP8 on the device against transformers (which dequantizes on CPU;
run in float32 here), against JAX with bf16 weights dequantized at load, and against itself on
8 simulated devices.

Compile budget (a set of layer programs costs ~10-20 s of CPU): every JAX run on the fp32 FP8
model uses the generator options of eval/generators.py's JAX adapter (8 slots of 8192 tokens,
pow2 token buckets) and the same two prompts as the GSM8K run, which generates one token, so the
GSM8K CLI, the text generation and the logits comparison share one set of prefill programs; the
bf16 pair adds two, the 8-device subprocess one. Decoding with FP8 weights runs the same layer
code at other shapes (its chunked / decode paths are tests/jax/test_model.py's). Torch is
imported by the tests only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")

from dsv4_jax.model import (  # noqa: E402
    DeepseekV4,
    ModelConfig,
    parallel,  # noqa: E402
)
from dsv4_jax.model.checkpoint import held_bytes, load_checkpoint, load_params, plan_params, quant_block  # noqa: E402
from dsv4_jax.model.generate import JaxGenerator  # noqa: E402
from dsv4_jax.model.quant import QuantizedWeight  # noqa: E402
from dsv4_jax.model.safetensors_io import CheckpointFiles, read_safetensors, write_safetensors  # noqa: E402
from tools import official_checkpoint as oc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# eval/generators.py's JaxGenerator.from_checkpoint: the GSM8K run compiles exactly these programs
EVAL_OPTIONS = dict(max_batch_size=8, max_model_len=8192)
TOL = 1e-4


@pytest.fixture(scope="session")
def official(tmp_path_factory):
    return oc.write_official_checkpoint(tmp_path_factory.mktemp("official") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def official_base(tmp_path_factory):
    """V4-Flash-Base's layout: FP8 experts with F32 scales."""
    return oc.write_official_checkpoint(tmp_path_factory.mktemp("official-base") / "ckpt", seed=0, experts="fp8")


@pytest.fixture(scope="session")
def gsm_data(tmp_path_factory):
    """Two GSM8K-style documents per split (from the tiny tokenizer's corpus), original format."""
    from tools.tiny_checkpoint import corpus

    d = tmp_path_factory.mktemp("gsm8k")
    docs = [dict(zip(("question", "answer"), p.split("\n", 1))) for p in corpus(4, seed=7)]
    for name, part in (("test.jsonl", docs[:2]), ("train.jsonl", docs[2:])):
        (d / name).write_text("".join(json.dumps(x) + "\n" for x in part))
    return d, [f"Question: {x['question']}\nAnswer:" for x in docs[:2]]


@pytest.fixture(scope="session")
def hf_fp32(official):
    """transformers' model of the official directory (it dequantizes on load), in float32."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.DeepseekV4ForCausalLM.from_pretrained(official, dtype=torch.float32).float().eval()


def _hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].numpy()


def _err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


# ----------------------------------------------------------------------------- the writer


def test_writer_quantizes_as_deepseek_does():
    w = np.zeros((130, 200), np.float32)
    w[0, 0], w[129, 199], w[5, 130] = 448.0 * 3, -0.001, 1.0
    q, s = oc.quantize_fp8(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == ml_dtypes.float8_e8m0fnu and s.shape == (2, 2)
    # scale = 2^ceil(log2(amax / 448)); an all-zero block takes amax 1e-4
    assert s.astype(np.float32).tolist() == [[4.0, 2.0**-8], [2.0**-22, 2.0**-18]]
    assert np.abs(oc.dequantize(q, s) - w).max() <= 448 * 3 / 16
    # e2m1 round-to-nearest-even, low nibble = element 2k
    row = np.array([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0] + [0.0] * 24], np.float32)
    packed, scale = oc.quantize_fp4(row)
    assert scale.astype(np.float32).tolist() == [[1.0]] and packed.dtype == np.int8 and packed.shape == (1, 16)
    assert oc.dequantize(packed, scale)[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0]
    assert packed.view(np.uint8)[0, :4].tolist() == [0x2 << 4 | 0x0, 0x4 << 4 | 0x2, 0x6 << 4 | 0x4, 0xF << 4 | 0x6]


def test_writer_layout(official):
    files = CheckpointFiles(official)
    index = json.loads((official / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2 and set(index["weight_map"]) == set(files.names())
    info = files.info
    assert info("layers.2.attn.wq_b.weight").st_dtype == "F8_E4M3"
    assert info("layers.2.attn.wq_b.scale").st_dtype == "F8_E8M0" and info("layers.2.attn.wq_b.scale").shape == (32, 1)
    assert info("layers.2.ffn.experts.3.w1.weight").st_dtype == "I8" and info(
        "layers.2.ffn.experts.3.w1.weight"
    ).shape == (64, 32)
    assert info("layers.2.ffn.experts.3.w1.scale").shape == (64, 2)
    assert info("layers.2.attn.compressor.wkv.weight").st_dtype == "BF16" and info("embed.weight").st_dtype == "BF16"
    assert info("layers.2.hc_attn_fn").st_dtype == "F32" and info("layers.0.ffn.gate.tid2eid").st_dtype == "I64"
    assert any(n.startswith("mtp.0.") for n in files.names())
    cfg = json.loads((official / "config.json").read_text())
    assert cfg["quantization_config"] == oc.QUANTIZATION_CONFIG and cfg["expert_dtype"] == "fp4"
    assert quant_block(cfg) == (128, 128) and ModelConfig.from_checkpoint(official) == ModelConfig.from_name("tiny")


# ----------------------------------------------------------------------------- loading


def test_loads_as_shipped_and_dequantizes_exactly(official, official_base):
    raw = read_safetensors(official)
    cfg, p = load_checkpoint(official)
    wq_b, w13 = p["layers"][2]["attn"]["wq_b"], p["layers"][2]["ffn"]["w13"]
    assert isinstance(wq_b, QuantizedWeight) and wq_b.fmt == "fp8" and wq_b.data.dtype == jax.numpy.float8_e4m3fn
    assert wq_b.scale.dtype == np.uint8 and wq_b.shape == (4096, 64)
    assert (
        isinstance(w13, QuantizedWeight)
        and w13.fmt == "fp4"
        and w13.data.shape == (8, 128, 32)
        and w13.shape == (8, 128, 64)
    )
    assert p["embed"].dtype == jax.numpy.bfloat16 and p["layers"][2]["attn_hc"]["fn"].dtype == np.float32
    # nothing is widened on the device: the bytes are the checkpoint's (MTP dropped, tid2eid int64 -> int32)
    stored = sum(a.nbytes for n, a in raw.items() if not n.startswith("mtp."))
    tid = sum(a.nbytes for n, a in raw.items() if n.endswith("tid2eid") and not n.startswith("mtp."))
    assert parallel.weight_bytes(p) == stored - tid // 2
    # dequantized on the device == NumPy dequantization of the stored bytes, bit for bit
    np.testing.assert_array_equal(
        np.asarray(wq_b.dequantize()), oc.dequantize(raw["layers.2.attn.wq_b.weight"], raw["layers.2.attn.wq_b.scale"])
    )
    ref = np.stack(
        [
            np.concatenate(
                [
                    oc.dequantize(
                        raw[f"layers.2.ffn.experts.{e}.{w}.weight"], raw[f"layers.2.ffn.experts.{e}.{w}.scale"]
                    )
                    for w in ("w1", "w3")
                ]
            )
            for e in range(8)
        ]
    )
    np.testing.assert_array_equal(np.asarray(w13.dequantize()), ref)
    _, d = load_checkpoint(official, weights="dequantized", dtype="bfloat16")
    assert d["layers"][2]["attn"]["wq_b"].dtype == jax.numpy.bfloat16  # e4m3 * 2^k is exact in bf16
    np.testing.assert_array_equal(np.asarray(d["layers"][2]["attn"]["wq_b"], np.float32), np.asarray(wq_b.dequantize()))
    # V4-Flash-Base: FP8 experts with F32 scales
    raw_b = read_safetensors(official_base)
    _, b = load_checkpoint(official_base)
    w2 = b["layers"][3]["ffn"]["w2"]
    assert w2.fmt == "fp8" and w2.scale.dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(w2.dequantize())[5],
        oc.dequantize(raw_b["layers.3.ffn.experts.5.w2.weight"], raw_b["layers.3.ffn.experts.5.w2.scale"]),
    )


def _write_raw(path: Path, header, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def test_corrupt_files_name_the_file_and_tensor(tmp_path):
    def bad(name, content, match):
        f = tmp_path / name
        if isinstance(content, bytes):
            f.write_bytes(content)
        else:
            _write_raw(f, *content)
        with pytest.raises(ValueError, match=match) as e:
            CheckpointFiles(f)
        assert name in str(e.value)

    bad("short.safetensors", b"\x01\x02", "not a safetensors file")
    bad("long.safetensors", (10**9).to_bytes(8, "little") + b"{}", "header length 1000000000")
    bad("json.safetensors", (b"{no json",), "not JSON")
    bad("list.safetensors", (b"[1, 2]",), "expected a JSON object")
    bad(
        "dtype.safetensors",
        ({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0"),
        "'w' has unknown dtype 'F4'",
    )
    bad(
        "size.safetensors",
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
        "'w': 4 bytes for shape",
    )
    bad(
        "range.safetensors",
        ({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, b"\0" * 4),
        "'w' has data_offsets",
    )
    bad(
        "overlap.safetensors",
        (
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
        ),
        "overlap",
    )
    bad("entry.safetensors", ({"w": {"dtype": "U8"}},), "'w' needs dtype, shape and data_offsets")
    ok = write_safetensors(
        tmp_path / "ok.safetensors",
        {"a": np.arange(3, dtype=np.int16), "s": np.array([127], np.uint8).view(ml_dtypes.float8_e8m0fnu)},
    )
    with CheckpointFiles(ok) as f:
        assert f.array("a").tolist() == [0, 1, 2] and f.array("s").astype(np.float32).tolist() == [1.0]


def test_sharded_index_errors(official, tmp_path):
    def copy():
        d = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(official, d)
        return d

    d = copy()
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing shard 'model-00002-of-00002.safetensors'"):
        load_checkpoint(d)
    d = copy()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["embed.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lists tensor 'embed.weight' there, but the file lacks it"):
        load_checkpoint(d)
    d = copy()
    (d / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match="index.json: not JSON"):
        load_checkpoint(d)
    d = copy()
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(
        json.dumps({**c, "quantization_config": {**c["quantization_config"], "quant_method": "awq"}})
    )
    with pytest.raises(ValueError, match="quant_method"):
        load_checkpoint(d)


def test_bad_tensors_name_the_tensor(official):
    raw = dict(read_safetensors(official))
    cfg = ModelConfig.from_name("tiny")

    def bad(match, drop=(), **replace):
        t = {k: v for k, v in raw.items() if k not in drop}
        t.update({k.replace("__", "."): v for k, v in replace.items()})
        with pytest.raises(ValueError, match=match):
            load_params(cfg, t)

    e4m3, e8m0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu
    bad(
        r"'layers.0.attn.wq_a.weight' has shape \(64, 32\), the config needs \(64, 64\)",
        layers__0__attn__wq_a__weight=np.zeros((64, 32), e4m3),
    )
    bad(r"scale 'layers.0.attn.wq_a.scale' has shape \(2, 1\)", layers__0__attn__wq_a__scale=np.zeros((2, 1), e8m0))
    bad("scale 'layers.0.attn.wq_a.scale' has dtype F16", layers__0__attn__wq_a__scale=np.ones((1, 1), np.float16))
    bad("'layers.0.attn.wq_a.weight' has dtype F8_E4M3 without a .scale", drop=("layers.0.attn.wq_a.scale",))
    bad(
        r"'layers.3.ffn.experts.2.w2.weight' has shape \(64, 48\)",
        layers__3__ffn__experts__2__w2__weight=np.zeros((64, 24), np.int8),
    )
    bad("layer 3 has experts", drop=("layers.3.ffn.experts.7.w2.weight", "layers.3.ffn.experts.7.w2.scale"))
    bad("does not use", layers__0__attn__bogus=np.zeros(3, np.float32))
    bad(
        "missing 'model.layers.2.self_attn.q_b_proj.weight'",
        drop=("layers.2.attn.wq_b.weight", "layers.2.attn.wq_b.scale"),
    )
    bad("'layers.1.attn_norm.weight' has a scale", layers__1__attn_norm__scale=np.ones((1,), e8m0))
    bad("'layers.0.ffn.gate.tid2eid' has dtype F32", layers__0__ffn__gate__tid2eid=np.zeros((512, 2), np.float32))
    with pytest.raises(ValueError, match="weights"):
        load_params(cfg, raw, weights="fp8")
    with pytest.raises(ValueError, match="dtype"):
        load_params(cfg, raw, dtype="int8")
    # MTP tensors are read (their headers checked) and not used
    assert (
        load_params(cfg, {k: v for k, v in raw.items() if not k.startswith("mtp.")})["layers"][0].keys()
        == load_params(cfg, raw)["layers"][0].keys()
    )


def test_transformers_loads_the_official_format_to_the_same_weights(official, hf_fp32):
    """transformers (with accelerate) dequantizes the FP8 / FP4 weights on load: every tensor
    equals our dequantization of the same bytes."""
    from dsv4_jax.model.checkpoint import to_transformers_names

    model = hf_fp32
    raw = read_safetensors(official)
    plain = {}
    for name, a in raw.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in raw or name.startswith("mtp."):
            continue
        scale = name[: -len(".weight")] + ".scale"
        if name.endswith(".weight") and scale in raw:
            plain[name] = oc.dequantize(a, raw[scale])
        else:
            plain[name] = a.astype(np.float32) if a.dtype.kind != "i" else a
    ours, theirs = to_transformers_names(plain), model.state_dict()
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        np.testing.assert_array_equal(np.asarray(t, theirs[name].numpy().dtype), theirs[name].numpy(), err_msg=name)


def test_v4_flash_bytes_per_device_from_the_headers():
    """The split rules on V4-Flash's real shapes (43 layers, 256 FP4 experts; no arrays made)."""
    flash = ModelConfig.from_name("V4-Flash")
    cfg = oc.flash_like_config(compress_ratios=flash.compress_ratios, n_routed_experts=256, num_hash_layers=3)
    assert ModelConfig.from_dict(cfg) == flash

    files = oc.LayoutHeaders(oc.official_layout(cfg))
    tree, _ = plan_params(flash, files)
    held, total = held_bytes(tree, files, 8)
    assert 150e9 < total < 160e9  # ~156 GB as shipped (FP4 experts), MTP not loaded
    assert abs(held / (total / 8) - 1) < 0.01, held / total


# ----------------------------------------------------------------------------- the model


def test_gsm8k_cli_runs_on_the_official_format(official, gsm_data, hf_fp32, tmp_path):
    """`python -m eval.gsm8k --framework jax --checkpoint DIR --limit 2` (in-process: main()); its
    greedy token is transformers' on the dequantized weights. One new token: the run compiles only
    the prefill programs, which the tests below reuse."""
    from tokenizers import Tokenizer

    from eval import gsm8k

    data, prompts = gsm_data
    out = tmp_path / "report.json"
    rc = gsm8k.main(
        [
            "--framework",
            "jax",
            "--checkpoint",
            str(official),
            "--limit",
            "2",
            "--data",
            str(data),
            "--num-fewshot",
            "0",
            "--max-new-tokens",
            "1",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["num_problems"] == 2 and report["config"]["framework"] == "jax"
    tok = Tokenizer.from_file(str(official / "tokenizer.json"))
    for text, problem in zip(prompts, report["problems"]):
        ids = tok.encode(text).ids
        assert len(ids) == problem["prompt_tokens"]
        assert problem["generated_token_ids"] == [int(np.argmax(_hf_logits(hf_fp32, ids)[-1]))]


@pytest.fixture(scope="session")
def fp8_generator(official):
    return JaxGenerator(official, **EVAL_OPTIONS)


@pytest.fixture(scope="session")
def fp8_logits(fp8_generator, gsm_data):
    """fp32 logits of both prompts, one ragged prefill step (the GSM8K run's shapes)."""
    gen = fp8_generator
    ids = [gen.encode(t) for t in gsm_data[1]]
    _, out = gen.model.step(gen.model.init_cache(), [0, 1], [0, 0], ids, all_tokens=True)
    return ids, out.request_logits()


def test_fp8_on_device_matches_transformers(fp8_logits, fp8_generator, gsm_data, hf_fp32):
    """fp32 logits of JAX with FP8 / FP4 weights on the device vs transformers' dequantized model
    at every position, and the greedy token at every position; text in, text out."""
    ids, logits = fp8_logits
    for i, got in zip(ids, logits):
        ref = _hf_logits(hf_fp32, i)
        assert ref.std() > 0.5 and _err(got, ref) < TOL
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    gen = fp8_generator
    texts = gen.generate(gsm_data[1], max_new_tokens=1, stop_token_ids=())
    tokens = gen.generate(ids, max_new_tokens=1)
    assert tokens == [[int(np.argmax(lg[-1]))] for lg in logits]
    assert texts == [gen.decode(t) for t in tokens] and all(isinstance(t, str) for t in texts)
    with pytest.raises(TypeError, match="mix"):
        gen.generate([gsm_data[1][0], ids[0]], 1)


def test_fp8_on_device_equals_bf16_dequantized_at_load(official, fp8_logits):
    """bfloat16 compute: FP8 / FP4 weights dequantized inside the matmuls give the same logits
    as weights dequantized to bf16 at load (the dequantization is exact in bf16)."""
    ids, ref32 = fp8_logits
    runs = {}
    for weights in ("stored", "dequantized"):
        m = DeepseekV4.from_checkpoint(
            official, dtype="bfloat16", weights=weights, token_buckets="pow2", **EVAL_OPTIONS
        )
        _, out = m.step(m.init_cache(), [0, 1], [0, 0], ids, all_tokens=True)
        runs[weights] = [np.asarray(lg, np.float32) for lg in out.request_logits()]
    for a, b, r in zip(runs["stored"], runs["dequantized"], ref32):
        np.testing.assert_array_equal(a, b)
        assert (a.argmax(-1) == b.argmax(-1)).all()
        rel = float(np.sqrt(np.mean((a - r) ** 2) / np.mean(r**2)))
        assert rel < 0.1, rel  # bf16 compute through 6 layers against fp32: a loose sanity bound


SHARDED_SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from dsv4_jax.model import DeepseekV4, parallel
assert len(jax.devices()) == 8
mesh = jax.make_mesh((8,), ("tp",))  # Explicit axes: the model works on an Auto copy
ids = json.loads(sys.argv[2])
m = DeepseekV4.from_checkpoint(sys.argv[1], mesh=mesh, axis="tp", token_buckets="pow2", max_batch_size=8, max_model_len=8192)
per_device = parallel.device_bytes(m.params)
split = [a for a in jax.tree.leaves(m.params) if a.sharding.spec != P()]
split_dev = parallel.device_bytes(split)
_, out = m.step(m.init_cache(), [0, 1], [0, 0], ids, all_tokens=True)
np.savez(sys.argv[3], *out.request_logits())
print(json.dumps({"total": parallel.weight_bytes(m.params), "per_device": sorted(per_device.values()),
                  "split_total": parallel.weight_bytes(split), "split_per_device": sorted(split_dev.values()),
                  "n_split": len(split), "n_all": len(jax.tree.leaves(m.params))}))
"""


def test_sharded_over_8_devices_equals_one_device(official, fp8_logits, tmp_path):
    """8 simulated CPU devices (a subprocess: XLA_FLAGS is read at JAX start-up): each holds 1/8
    of the weights and the logits equal the one-device run's."""
    ids, ref = fp8_logits
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "sharded.npz"
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, str(official), json.dumps(ids), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(abs(b / (r["total"] / 8) - 1) < 0.05 for b in r["per_device"]), r
    assert r["split_per_device"] == [r["split_total"] // 8] * 8, r  # every split array splits evenly
    assert r["split_total"] > 0.99 * r["total"], r  # only a few small vectors stay whole
    got = np.load(out)
    for i, want in enumerate(ref):
        assert _err(got[f"arr_{i}"], want) < 1e-5
