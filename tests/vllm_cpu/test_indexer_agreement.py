"""vLLM's CPU engine with the plugin's Lightning Indexer (`dsv4_torch.vllm.cpu.indexer`): a
V4-Flash-shaped (index_topk 512) and a V4-Pro-shaped (index_topk 1024) small checkpoint served,
each agreeing with our JAX model teacher-forced (test_agreement.py's envelope: JAX bf16 + the fp8
cache against JAX float32), our kernel on every indexer token of every CSA layer;
`DSV4_PREFILL_VLLM_CPU_PREFILL=vllm` keeps vLLM's own indexer (index_topk 512 only: vLLM asserts it).

The prompts are long enough that the indexer selects: 6000 tokens see 1500 compressed entries,
more than either index_topk.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.vllm_cpu.conftest import MAIN_PYTHON, engine, run_python
from tests.vllm_cpu.test_agreement import _compare, _within

LENGTHS = (6000, 1100)
NEW_TOKENS = 4
CSA_LAYERS = 2  # the tiny layer pattern: SWA, SWA, CSA, HCA, CSA, HCA


@pytest.fixture(scope="module", params=[512, 1024], ids=["v4-flash-shaped", "v4-pro-shaped"])
def case(request, tmp_path_factory):
    from tools.official_checkpoint import vllm_cpu_config, write_official_checkpoint

    topk = request.param
    ckpt = write_official_checkpoint(
        tmp_path_factory.mktemp(f"ckpt-{topk}"), seed=0, config=vllm_cpu_config(index_topk=topk)
    )
    g = np.random.default_rng(topk)
    prompts = [g.integers(3, 512, n).tolist() for n in LENGTHS]
    kernels = ["dsv4", "vllm"] if topk == 512 else ["dsv4"]
    spec = {
        "checkpoint": str(ckpt),
        "prompts": prompts,
        "max_new_tokens": NEW_TOKENS,
        "max_num_batched_tokens": 2048,
        "max_model_len": 8192,
        "kernels": kernels,
    }
    runs = engine(spec, tmp_path_factory.mktemp(f"engine-{topk}"))
    seqs = [p + r["generated"] for p, r in zip(prompts, runs["runs"]["dsv4"]["requests"])]
    tmp = tmp_path_factory.mktemp(f"refs-{topk}")
    ref_spec = {
        "checkpoint": str(ckpt),
        "sequences": seqs,
        "runs": [
            {"name": "jax_fp32", "framework": "jax", "dtype": "float32"},
            {"name": "jax_bf16_fp8", "framework": "jax", "dtype": "bfloat16", "kv_cache_dtype": "fp8_ds_mla"},
        ],
    }
    (tmp / "spec.json").write_text(json.dumps(ref_spec))
    run_python(
        MAIN_PYTHON, "tests.vllm_cpu.reference_run", tmp / "spec.json", tmp / "out.json", env={"JAX_PLATFORMS": "cpu"}
    )
    return dict(topk=topk, runs=runs, refs=json.loads((tmp / "out.json").read_text()))


def test_our_indexer_ran_on_every_indexer_token(case):
    s = case["runs"]["runs"]["dsv4"]["stats"]
    tokens = sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1)
    # every token of every CSA layer, once (the first steps may take vLLM's short-context fill:
    # while the longest context holds no more than index_topk entries every entry is selected)
    assert s["dsv4_indexer_calls"] > 0 and 0 < s["dsv4_indexer_tokens"] <= CSA_LAYERS * tokens, s
    if "vllm" in case["runs"]["runs"]:
        theirs = case["runs"]["runs"]["vllm"]["stats"]
        assert theirs["dsv4_indexer_calls"] == 0 and theirs["dsv4_indexer_tokens"] == 0, theirs


def test_served_within_the_envelope(case):
    env = _compare(case["refs"]["jax_bf16_fp8"], case["refs"]["jax_fp32"])
    assert env["max"] > 0
    _within(
        f"vLLM + our indexer (index_topk {case['topk']}) vs jax_fp32",
        _compare(case["runs"]["runs"]["dsv4"], case["refs"]["jax_fp32"]),
        env,
    )
