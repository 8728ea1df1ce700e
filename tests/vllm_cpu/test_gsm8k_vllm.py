"""`python -m eval.gsm8k --framework vllm`: the same prompts, filters and report through vLLM's
offline API on its CPU engine with our plugin (the small real-shaped random checkpoint: accuracy is
not the point; the prompts, the stops, the scoring and which kernel ran are)."""

from __future__ import annotations

import json
import sys

import pytest

from eval import gsm8k as E
from eval import gsm8k_task as T
from tests.vllm_cpu.conftest import run_python

LAYERS = 6


@pytest.fixture(scope="module")
def data():
    try:
        return T.load_gsm8k()
    except FileNotFoundError as e:
        pytest.skip(f"GSM8K data absent ({e})")


def test_gsm8k_cli_through_vllm(checkpoint, data, tmp_path):
    out = tmp_path / "report.json"
    stdout = run_python(
        sys.executable,
        "eval.gsm8k",
        "--checkpoint",
        checkpoint,
        "--framework",
        "vllm",
        "--limit",
        3,
        "--num-fewshot",
        1,
        "--max-new-tokens",
        12,
        "--no-progress",
        "--output",
        out,
    )
    assert "gsm8k 3 problems, 1-shot" in stdout
    report = json.loads(out.read_text())
    g = report["a"]["config"]["generator"] if "a" in report else report["config"]["generator"]
    assert (
        g["framework"] == "vllm" and g["dtype"] == "bfloat16" and g["plugin_active"] and g["prefill_kernel"] == "dsv4"
    )
    prompts = T.build_prompts(data.test, data.train, num_fewshot=1, limit=3)
    assert [p["prompt_id"] for p in report["problems"]] == [p.prompt_id for p in prompts]
    prompt_tokens = sum(p["prompt_tokens"] for p in report["problems"])
    stats = g["plugin_stats"]
    # every prompt token went through our prefill kernel in every layer (one-token chunks aside)
    assert stats["dsv4_prefill_tokens"] >= LAYERS * (prompt_tokens - stats["steps"]), stats
    assert stats["dsv4_prefill_tokens"] <= LAYERS * prompt_tokens, stats
    for p in report["problems"]:
        assert 1 <= len(p["generated_token_ids"]) <= 12
        assert not any(s in p["output"] for s in T.STOP_STRINGS)  # cut at the first stop string
        assert p["correct"] == T.score_output(p["output"], data.test[p["doc_id"]]["answer"])["correct"]
    t = report["throughput"]
    assert t["prefill"]["tokens"] == prompt_tokens and t["prefill"]["seconds"] > 0


def test_vllm_framework_options_are_checked():
    with pytest.raises(ValueError, match=r"backend \(--attention\): for framework=vllm"):
        E.RunConfig(checkpoint="ckpt", framework="vllm", backend="xla", dtype="bfloat16").resolved()
    base = E.RunConfig(checkpoint="ckpt")
    cfg = E.apply_overrides(base, "framework=vllm")
    assert (cfg.backend, cfg.dtype) == ("auto", "bfloat16")
    assert E.apply_overrides(base, "framework=vllm,attention=vllm").backend == "vllm"
    from eval.vllm_generator import VllmEvalGenerator

    with pytest.raises(ValueError, match="bfloat16"):
        VllmEvalGenerator.from_checkpoint("ckpt", dtype="float32")
