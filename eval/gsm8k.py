"""GSM8K on a DeepSeek-V4 checkpoint, scored exactly like lm-evaluation-harness's `gsm8k` task.

    python -m eval.gsm8k                                   # tiny random checkpoint, small slice
    python -m eval.gsm8k --checkpoint DIR --attention reference --planner adaptive --output report.json
    python -m eval.gsm8k --checkpoint DIR --compare planner=adaptive planner=fixed
    python -m eval.gsm8k --checkpoint DIR --compare attention=eager attention=reference,batch_size=16
    python -m eval.gsm8k --checkpoint DIR --framework vllm   # vLLM's CPU engine + our plugin (.venv-vllm-cpu)
    python -m eval.gsm8k --checkpoint DIR --framework vllm --compare attention=dsv4 attention=vllm

`--attention` picks the attention backend (`backend=` of the Python API) and `--planner` the chunk
plan's policy (`policy=`); `--compare` takes either spelling (`planner=` or `policy=`, `attention=`
or `backend=`).

What is reproduced, read from EleutherAI/lm-evaluation-harness (commit 4e7e0d47, task version 3.0):
`lm_eval/tasks/gsm8k/gsm8k.yaml`, `lm_eval/api/task.py` (`fewshot_context`, `build_qa_turn`,
`build_all_requests`), `lm_eval/api/samplers.py` (`ContextSampler.sample`), `lm_eval/evaluator.py`
and `lm_eval/defaults.py` (fewshot seed 1234), `lm_eval/filters/extraction.py` (`RegexFilter`),
`lm_eval/filters/selection.py` (`take_first`), `lm_eval/api/metrics.py` (`exact_match_hf_evaluate`,
`mean_stderr`), `lm_eval/models/huggingface.py` and `lm_eval/models/utils.py` (`generate_until`).

- Prompt: for each few-shot document `"Question: {question}\\nAnswer:" + " " + answer + "\\n\\n"`,
  then `"Question: {question}\\nAnswer:"` of the test document (no trailing space; no system prompt,
  no description, no chat template).
- Few-shot examples: `random.Random(seed)` (lm-eval's `--seed` fourth value, default 1234) is ONE
  generator shared by all test documents, drawn in test order: document i gets the (i+1)-th
  `rnd.sample(train, num_fewshot)`. So the examples differ per document and do not depend on
  `--limit`. We draw `rnd.sample(range(len(train)), k)`, which consumes the generator exactly as
  sampling the list does (`random.sample` only uses the population's length) and gives the indices.
- Generation: greedy; the continuation is decoded with `skip_special_tokens=True` and cut at the
  first occurrence of any of `until = ["Question:", "</s>", "<|im_end|>"]` plus the tokenizer's EOS
  text (lm-eval appends it); at most `--max-new-tokens` tokens (lm-eval's default `max_gen_toks` 256).
  Prompts are tokenized with the tokenizer's defaults (BOS iff the tokenizer adds one).
- Scoring: `strict-match` = first match of `#### (\\-?[0-9\\.\\,]+)`; `flexible-extract` = last match
  of `(-?[$0-9.,]{2,})|(-?[0-9]+)`, its first non-empty group; both stripped, `"[invalid]"` when
  nothing matches. exact_match: on prediction and reference alike, remove `,`, then `\\$`, then
  `(?s).*#### `, then `\\.$` (in that order, `re.sub`), then lower-case; the reference is the full
  answer field. Accuracy = mean; stderr = sample std (ddof 1) / sqrt(n).

Remaining differences from an lm-eval run:
- lm-eval's HF backend batches requests with left padding; for DeepSeek-V4's eager attention that
  changes tokens (see eval/generators.py), so eager runs one request at a time here. Our path
  (`--attention auto`, the torch default) runs ragged batches that equal per-request runs
  (`--compare attention=eager attention=reference` checks it).
- lm-eval stops a request when its stop string shows in the last few decoded tokens and stops the
  batch when all are done; we stop each request as soon as its whole decoded continuation holds a
  stop string or it emits EOS. The scored text is the same (lm-eval cuts at the first stop string).
- transformers' `generate` (lm-eval's path) also applies logits processors that a checkpoint's
  generation_config.json may set (e.g. `repetition_penalty`); we take the plain argmax.
- lm-eval left-truncates a prompt longer than max_length - max_gen_toks; we never truncate (V4's
  max_position_embeddings is 1M, so lm-eval never does either).
- With several ranks (`world_size > 1`) or `--samples`, lm-eval draws few-shot examples in another
  order; we reproduce the single-process run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from eval.generators import (
    BATCHING,
    DTYPES,
    JAX_BACKENDS,
    POLICIES,
    TORCH_BACKENDS,
    VLLM_BACKENDS,
    Generator,
    SetupError,
    load_generator,
)

FRAMEWORKS = ("torch", "jax", "vllm")
FRAMEWORK_BACKENDS = {"torch": TORCH_BACKENDS, "jax": JAX_BACKENDS, "vllm": VLLM_BACKENDS}

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CHECKPOINT_DIR = REPO_ROOT / "out" / "tiny-ckpt"
DEFAULT_OUTPUT = REPO_ROOT / "out" / "gsm8k-report.json"
HUB_DATASET = ("openai/gsm8k", "main")

# lm-eval gsm8k.yaml (version 3.0) and its defaults
LM_EVAL_TASK_VERSION = 3.0
QUESTION_TEMPLATE = "Question: {question}\nAnswer:"
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
STOP_STRINGS = ("Question:", "</s>", "<|im_end|>")
DEFAULT_NUM_FEWSHOT = 5
DEFAULT_FEWSHOT_SEED = 1234
DEFAULT_MAX_NEW_TOKENS = 256
STRICT_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_PATTERN = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORE_REGEXES = (",", r"\$", r"(?s).*#### ", r"\.$")
FALLBACK = "[invalid]"
METRICS = ("strict-match", "flexible-extract")

# what `python -m eval.gsm8k` with no --checkpoint runs: the tiny random checkpoint, a small slice
# (its eager 5-shot prefill, ~2200 tokens at head_dim 512, takes ~10 s per problem on 2 CPU cores;
# the default torch attention is our sparse path, batched)
TINY_LIMIT = 8
TINY_NUM_FEWSHOT = 1
TINY_MAX_NEW_TOKENS = 32


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class GSM8K:
    """The two splits as lists of `{"question": str, "answer": str}` and where they came from."""

    test: list
    train: list
    source: str


def read_jsonl(path: Path) -> list[dict]:
    """One GSM8K split in the original release's format: a JSON object per line with `question`
    and `answer` strings (blank lines skipped)."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(doc, dict) or not all(isinstance(doc.get(k), str) for k in ("question", "answer")):
                raise ValueError(f"{path}:{lineno}: expected an object with 'question' and 'answer' strings")
            docs.append({"question": doc["question"], "answer": doc["answer"]})
    if not docs:
        raise ValueError(f"{path}: no problems in the file")
    return docs


def data_dir_candidates() -> list[tuple[str, Path]]:
    """Where to look without --data: $GSM8K_DIR, then `shared/gsm8k` next to the repo root or next
    to any folder above it (`../shared/gsm8k` first)."""
    found = []
    if os.environ.get("GSM8K_DIR"):
        found.append(("$GSM8K_DIR", Path(os.environ["GSM8K_DIR"])))
    for parent in REPO_ROOT.parents:
        found.append(("shared folder", parent / "shared" / "gsm8k"))
    return found


def load_gsm8k(data_dir: str | Path | None = None) -> GSM8K:
    """Load test and train splits.

    data_dir: a folder holding `test.jsonl` and `train.jsonl`. None: the first of
      `data_dir_candidates()` that holds both, else the hub dataset `openai/gsm8k` (config `main`)
      through `datasets` if it is installed and the hub answers. Raises FileNotFoundError naming
      everything tried.
    """
    if data_dir is not None:
        d = Path(data_dir)
        missing = [n for n in ("test.jsonl", "train.jsonl") if not (d / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"--data {d}: missing {', '.join(missing)} (expected GSM8K's test.jsonl and train.jsonl)"
            )
        return GSM8K(read_jsonl(d / "test.jsonl"), read_jsonl(d / "train.jsonl"), str(d.resolve()))
    tried = []
    for label, d in data_dir_candidates():
        if (d / "test.jsonl").is_file() and (d / "train.jsonl").is_file():
            return GSM8K(read_jsonl(d / "test.jsonl"), read_jsonl(d / "train.jsonl"), str(d.resolve()))
        tried.append(f"{label} {d} (no test.jsonl/train.jsonl)")
    try:
        import datasets
    except ImportError:
        tried.append(f"hub dataset {HUB_DATASET[0]} (the `datasets` package is not installed)")
    else:
        try:
            ds = datasets.load_dataset(*HUB_DATASET)
            pick = lambda split: [{"question": r["question"], "answer": r["answer"]} for r in ds[split]]  # noqa: E731
            return GSM8K(pick("test"), pick("train"), f"hub:{HUB_DATASET[0]}/{HUB_DATASET[1]}")
        except Exception as e:  # offline, no such dataset, ...
            tried.append(f"hub dataset {HUB_DATASET[0]} ({type(e).__name__}: {str(e)[:200]})")
    raise FileNotFoundError(
        "GSM8K data not found. Tried: "
        + "; ".join(tried)
        + ". Pass --data DIR with test.jsonl and train.jsonl (the original GSM8K release format) or set GSM8K_DIR."
    )


# ----------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    """One test document's request: `doc_id` (index in the test split), the prompt `text`, the train
    indices of its few-shot examples in prompt order, and `prompt_id` (first 16 hex of its sha256)."""

    doc_id: int
    text: str
    fewshot_ids: tuple

    @property
    def prompt_id(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()[:16]


def doc_to_text(doc: dict) -> str:
    """`"Question: {question}\\nAnswer:"` (lm-eval's doc_to_text)."""
    return QUESTION_TEMPLATE.format(question=doc["question"])


def build_prompt(doc: dict, fewshot_docs: Sequence[dict]) -> str:
    """The plain-text context lm-eval's `fewshot_context` builds: each example as question, `" "`,
    full answer, `"\\n\\n"`; then the test question ending in `"Answer:"`."""
    shots = "".join(doc_to_text(d) + TARGET_DELIMITER + d["answer"] + FEWSHOT_DELIMITER for d in fewshot_docs)
    return shots + doc_to_text(doc)


def sample_fewshot_ids(
    num_train: int, num_fewshot: int, num_docs: int, seed: int = DEFAULT_FEWSHOT_SEED
) -> list[list[int]]:
    """Train indices of the few-shot examples of test documents 0..num_docs-1, as lm-eval draws them:
    one `random.Random(seed)`, `sample(population, num_fewshot)` once per document in test order."""
    for name, value, low in (("num_train", num_train, 0), ("num_fewshot", num_fewshot, 0), ("num_docs", num_docs, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    if num_fewshot > num_train:
        raise ValueError(f"num_fewshot: {num_fewshot} examples requested but the train split has {num_train}")
    if num_fewshot == 0:
        return [[] for _ in range(num_docs)]
    rnd = random.Random(seed)
    return [rnd.sample(range(num_train), num_fewshot) for _ in range(num_docs)]


def build_prompts(
    test: Sequence[dict],
    train: Sequence[dict],
    *,
    num_fewshot: int = DEFAULT_NUM_FEWSHOT,
    seed: int = DEFAULT_FEWSHOT_SEED,
    limit: int | None = None,
) -> list[Prompt]:
    """Prompts for the first `limit` test documents (all if None), few-shot examples from `train`."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit: expected an integer >= 1 or None, got {limit!r}")
    n = len(test) if limit is None else min(limit, len(test))
    ids = sample_fewshot_ids(len(train), num_fewshot, n, seed)
    return [Prompt(i, build_prompt(test[i], [train[j] for j in ids[i]]), tuple(ids[i])) for i in range(n)]


# ----------------------------------------------------------------------------- scoring


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """`text` up to the first occurrence of any non-empty stop string (lm-eval splits on each in turn)."""
    for s in stop_strings:
        if s:
            text = text.split(s)[0]
    return text


def _regex_filter(pattern: re.Pattern, text: str, group_select: int) -> str:
    """lm-eval's `RegexFilter`: `findall`, the `group_select`-th match, its first non-empty group,
    stripped; `"[invalid]"` when nothing matches."""
    matches = pattern.findall(text)
    if not matches:
        return FALLBACK
    match = matches[group_select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), FALLBACK)
    return match.strip()


def extract_strict(text: str) -> str:
    """`strict-match`: the number after the first `#### ` (`#### (\\-?[0-9\\.\\,]+)`), else `"[invalid]"`."""
    return _regex_filter(STRICT_PATTERN, text, 0)


def extract_flexible(text: str) -> str:
    """`flexible-extract`: the last match of `(-?[$0-9.,]{2,})|(-?[0-9]+)`, else `"[invalid]"`."""
    return _regex_filter(FLEXIBLE_PATTERN, text, -1)


def normalize(text: str) -> str:
    """lm-eval's exact_match preprocessing for gsm8k: remove `,`, `$`, everything up to the last
    `#### `, one trailing `.`; lower-case."""
    for pattern in IGNORE_REGEXES:
        text = re.sub(pattern, "", text)
    return text.lower()


def reference_answer(answer: str) -> str:
    """The normalised reference of a GSM8K answer field, e.g. `"... #### 1,080"` -> `"1080"`."""
    return normalize(answer)


def exact_match(prediction: str, answer: str) -> bool:
    """lm-eval's exact_match (ignore_case, regexes_to_ignore) of an extracted prediction against the
    full answer field. NumPy's string equality, which lm-eval uses, ignores trailing NUL characters."""
    return normalize(prediction).rstrip("\0") == reference_answer(answer).rstrip("\0")


def score_output(output: str, answer: str) -> dict:
    """Both extractions and their correctness for one truncated model output."""
    extracted = {"strict-match": extract_strict(output), "flexible-extract": extract_flexible(output)}
    return {"extracted": extracted, "correct": {m: exact_match(extracted[m], answer) for m in METRICS}}


def accuracy(flags: Sequence[bool]) -> dict:
    """Mean and lm-eval's stderr (sample std with ddof 1 over sqrt(n)) of 0/1 scores."""
    n, k = len(flags), sum(bool(f) for f in flags)
    if n == 0:
        return {"accuracy": None, "correct": 0, "total": 0, "stderr": None}
    p = k / n
    stderr = math.sqrt(p * (1 - p) * n / (n - 1) / n) if n > 1 else None
    return {"accuracy": p, "correct": k, "total": n, "stderr": stderr}


# ----------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class RunConfig:
    """One configuration of `--compare` (and of a plain run). `backend` (`--attention`) None: auto
    (our sparse path for torch, `dsv4_torch.hf.enable_sparse_prefill`; the JAX model's default for
    jax). `policy` (`--planner`): the chunk plan. `batching="auto"`: per request for eager, batched
    otherwise."""

    checkpoint: str
    framework: str = "torch"
    backend: str | None = None
    policy: str = "adaptive"
    batching: str = "auto"
    dtype: str = "float32"  # framework vllm: bfloat16 (its CPU DeepSeek-V4 path computes in it)
    device: str | None = None
    batch_size: int = 8

    def resolved(self) -> RunConfig:
        cfg = replace(self, backend=self.backend or "auto")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"framework: expected one of {FRAMEWORKS}, got {self.framework!r}")
        allowed = FRAMEWORK_BACKENDS[self.framework]
        if self.backend not in allowed:
            raise ValueError(
                f"backend (--attention): for framework={self.framework} expected one of {allowed}, got {self.backend!r}"
            )
        for name, value, choices in (
            ("policy (--planner)", self.policy, POLICIES),
            ("batching", self.batching, BATCHING),
            ("dtype", self.dtype, DTYPES),
        ):
            if value not in choices:
                raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size: expected an integer >= 1, got {self.batch_size!r}")


def _progress(total: int, label: str, enabled: bool):
    """A tqdm bar on stderr, or a plain `label: k/n` counter when tqdm is not installed."""
    if not enabled:
        return _Counter(total, label, None)
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=label, unit="problem", file=sys.stderr)
    except ImportError:
        return _Counter(total, label, sys.stderr)


class _Counter:
    def __init__(self, total, label, stream):
        self.n, self.total, self.label, self.stream = 0, total, label, stream

    def update(self, k):
        self.n += k
        if self.stream is not None:
            print(
                f"\r{self.label}: {self.n}/{self.total}",
                end="\n" if self.n >= self.total else "",
                file=self.stream,
                flush=True,
            )

    def close(self):
        pass


def evaluate(
    generator: Generator,
    prompts: Sequence[Prompt],
    test: Sequence[dict],
    *,
    batch_size: int = 8,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: bool = True,
    label: str = "gsm8k",
) -> dict:
    """Generate for every prompt (`batch_size` per `generate` call), score, and summarise.

    Returns the report body: `accuracy` per metric, `throughput`, `planner` figures (None when the
    backend reports no plan), and `problems` (one record per prompt).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an integer >= 1, got {batch_size!r}")
    codec = generator.codec
    stops = list(STOP_STRINGS) + ([codec.eos_text] if getattr(codec, "eos_text", None) else [])
    token_ids = [codec.encode(p.text) for p in prompts]
    first_step = len(generator.steps)
    problems = []
    bar = _progress(len(prompts), label, progress)
    start = time.perf_counter()
    for lo in range(0, len(prompts), batch_size):
        batch = list(range(lo, min(lo + batch_size, len(prompts))))
        outputs = generator.generate([token_ids[i] for i in batch], max_new_tokens, STOP_STRINGS)
        for i, generated in zip(batch, outputs):
            problems.append(_problem_record(prompts[i], token_ids[i], generated, test[prompts[i].doc_id], codec, stops))
        bar.update(len(batch))
    bar.close()
    wall = time.perf_counter() - start
    steps = generator.steps[first_step:]
    return {
        "accuracy": {m: accuracy([p["correct"][m] for p in problems]) for m in METRICS},
        "throughput": _throughput(steps, wall),
        "planner": _planner_summary(steps),
        "problems": problems,
    }


def _problem_record(prompt: Prompt, prompt_ids, generated, doc, codec, stops) -> dict:
    raw = codec.decode(generated)
    output = truncate_at_stop(raw, stops)
    if generated and generated[-1] in codec.eos_token_ids:
        stopped_by = "eos"
    elif output != raw:
        stopped_by = "stop_string"
    else:
        stopped_by = "max_new_tokens"
    return {
        "doc_id": prompt.doc_id,
        "prompt_id": prompt.prompt_id,
        "fewshot_ids": list(prompt.fewshot_ids),
        "prompt_tokens": len(prompt_ids),
        "output": output,
        "generated_token_ids": list(generated),
        "stopped_by": stopped_by,
        "target": reference_answer(doc["answer"]),
        **score_output(output, doc["answer"]),
    }


def _throughput(steps, wall) -> dict:
    out = {"wall_seconds": wall}
    for phase in ("prefill", "decode"):
        tokens = sum(s.tokens for s in steps if s.phase == phase)
        seconds = sum(s.seconds for s in steps if s.phase == phase)
        out[phase] = {
            "calls": sum(s.phase == phase for s in steps),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
        }
    return out


def _planner_summary(steps) -> dict | None:
    """Chunks per prefill step (per layer kind: mean and max, and every step) and peak workspace rows,
    or None when no step reported a plan."""
    if all(s.chunks is None and s.peak_workspace_rows is None for s in steps):
        return None
    prefill = [s for s in steps if s.phase == "prefill"]
    kinds = sorted({k for s in prefill if s.chunks for k in s.chunks})
    per_kind = {k: [s.chunks.get(k, 0) for s in prefill if s.chunks] for k in kinds}
    peaks = lambda ss: max((s.peak_workspace_rows for s in ss if s.peak_workspace_rows is not None), default=None)  # noqa: E731
    return {
        "chunks_per_prefill_step": {k: {"mean": sum(v) / len(v), "max": max(v)} for k, v in per_kind.items()},
        "peak_workspace_rows": {"prefill": peaks(prefill), "decode": peaks([s for s in steps if s.phase == "decode"])},
        "prefill_steps": [
            {
                "requests": s.requests,
                "tokens": s.tokens,
                "chunks": s.chunks,
                "peak_workspace_rows": s.peak_workspace_rows,
            }
            for s in prefill
        ],
    }


def run_config(cfg: RunConfig, prompts, test, *, max_new_tokens, progress=True, label="gsm8k") -> dict:
    """Load the generator of `cfg`, evaluate, free it; the report with its `config` section."""
    cfg = cfg.resolved()
    generator = load_generator(
        cfg.checkpoint,
        framework=cfg.framework,
        backend=cfg.backend,
        policy=cfg.policy,
        dtype=cfg.dtype,
        device=cfg.device,
        batching=cfg.batching,
        batch_size=cfg.batch_size,
    )
    try:
        body = evaluate(
            generator,
            prompts,
            test,
            batch_size=cfg.batch_size,
            max_new_tokens=max_new_tokens,
            progress=progress,
            label=label,
        )
        config = {f.name: getattr(cfg, f.name) for f in fields(cfg)} | {"generator": generator.describe()}
    finally:
        del generator
        gc.collect()
    return {"config": config, **body}


# ----------------------------------------------------------------------------- compare

OVERRIDE_KEYS = {f.name for f in fields(RunConfig)}
OVERRIDE_ALIASES = {"attention": "backend", "planner": "policy"}  # the CLI flags' spellings


def parse_overrides(spec: str) -> dict:
    """`"planner=fixed,attention=reference"` -> `{"policy": "fixed", "backend": "reference"}`.

    Keys: the fields of `RunConfig` (checkpoint, framework, backend, policy, batching, dtype,
    device, batch_size), or the CLI flags' spellings `attention` (= backend) and `planner`
    (= policy). An empty spec means no override (the base configuration).
    """
    if not isinstance(spec, str):
        raise TypeError(f"compare spec: expected a str, got {type(spec).__name__}")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"compare spec {spec!r}: expected comma-separated key=value items, got {item!r}")
        name = OVERRIDE_ALIASES.get(key, key)
        if name not in OVERRIDE_KEYS:
            allowed = ", ".join(sorted(OVERRIDE_KEYS | set(OVERRIDE_ALIASES)))
            raise ValueError(f"compare spec {spec!r}: unknown key {key!r} (allowed: {allowed})")
        if name in out:
            spellings = " / ".join([name] + [a for a, n in OVERRIDE_ALIASES.items() if n == name])
            raise ValueError(f"compare spec {spec!r}: key {spellings!r} given twice")
        key = name
        if key == "batch_size":
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"compare spec {spec!r}: batch_size must be an integer, got {value!r}") from None
        out[key] = value
    return out


def apply_overrides(base: RunConfig, spec: str) -> RunConfig:
    """`base` with the overrides of `spec`, validated."""
    overrides = parse_overrides(spec)
    framework = overrides.get("framework", base.framework)
    if "backend" not in overrides and base.backend not in FRAMEWORK_BACKENDS.get(framework, ()):
        overrides["backend"] = None  # the base backend does not exist there: that framework's default
    if "dtype" not in overrides and framework == "vllm" and base.framework != "vllm":
        overrides["dtype"] = "bfloat16"  # vLLM's CPU DeepSeek-V4 path computes in bfloat16
    cfg = replace(base, **overrides)
    return cfg.resolved()


def compare_runs(a: dict, b: dict) -> dict:
    """Agreement of two runs on the same prompts.

    a, b: reports of `evaluate`/`run_config`. Returns the fraction of problems whose generated token
    ids are identical, the first differing problem (doc id, first differing token index, the tokens
    from there and both outputs), and per metric the accuracy difference b - a and the doc ids whose
    correctness differs. Raises ValueError if the runs do not cover the same prompts.
    """
    pa, pb = a["problems"], b["problems"]
    key = lambda ps: [(p["doc_id"], p["prompt_id"]) for p in ps]  # noqa: E731
    if key(pa) != key(pb):
        raise ValueError("compare_runs: the two runs cover different prompts (doc ids or prompt ids differ)")
    identical = [x["generated_token_ids"] == y["generated_token_ids"] for x, y in zip(pa, pb)]
    first = None
    for x, y, same in zip(pa, pb, identical):
        if not same:
            tx, ty = x["generated_token_ids"], y["generated_token_ids"]
            at = next((i for i, (s, t) in enumerate(zip(tx, ty)) if s != t), min(len(tx), len(ty)))
            first = {
                "doc_id": x["doc_id"],
                "token_index": at,
                "a_tokens": tx[at : at + 8],
                "b_tokens": ty[at : at + 8],
                "a_output": x["output"],
                "b_output": y["output"],
            }
            break
    n = len(pa)
    acc = lambda r, m: sum(p["correct"][m] for p in r) / n if n else None  # noqa: E731
    return {
        "problems": n,
        "identical_problems": sum(identical),
        "token_agreement": sum(identical) / n if n else None,
        "first_difference": first,
        "accuracy_difference": {m: acc(pb, m) - acc(pa, m) if n else None for m in METRICS},
        "correctness_flips": {
            m: [x["doc_id"] for x, y in zip(pa, pb) if x["correct"][m] != y["correct"][m]] for m in METRICS
        },
    }


# ----------------------------------------------------------------------------- CLI


def ensure_tiny_checkpoint(out_dir: Path = TINY_CHECKPOINT_DIR, seed: int = 0) -> Path:
    """The tiny random checkpoint, written on first use by `tools.tiny_checkpoint`."""
    if all((out_dir / n).is_file() for n in ("config.json", "model.safetensors", "tokenizer.json")):
        return out_dir
    try:
        from tools.tiny_checkpoint import write_tiny_checkpoint
    except ModuleNotFoundError as e:
        raise SetupError(
            f"no --checkpoint given and the tiny checkpoint writer is missing ({e.name}): it needs "
            "tools.tiny_checkpoint (issue 6). Pass --checkpoint DIR with a DeepSeek-V4 checkpoint."
        ) from None
    print(f"writing the tiny random checkpoint to {out_dir}", file=sys.stderr)
    write_tiny_checkpoint(out_dir, seed=seed)
    return out_dir


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--checkpoint",
        help="checkpoint directory (config.json, *.safetensors, tokenizer.json); "
        f"default: the tiny random checkpoint in {TINY_CHECKPOINT_DIR.relative_to(REPO_ROOT)} (made on demand)",
    )
    p.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        default="torch",
        help="torch (transformers), jax (our JAX model) or vllm (vLLM's CPU engine with our plugin)",
    )
    p.add_argument(
        "--attention",
        dest="backend",
        metavar="BACKEND",
        help=f"attention backend (backend= in the API); torch: {'/'.join(TORCH_BACKENDS)} (default auto: our "
        f"sparse path; eager = transformers' own); jax: {'/'.join(JAX_BACKENDS)} (default auto)",
    )
    p.add_argument(
        "--planner",
        dest="policy",
        choices=POLICIES,
        default="adaptive",
        help="chunk-plan policy of our path (policy= in the API; unused by eager)",
    )
    p.add_argument(
        "--batching",
        choices=BATCHING,
        default="auto",
        help="auto: one request at a time for eager, ragged batches for our path",
    )
    p.add_argument(
        "--limit", type=int, help=f"first N test problems (default all 1319; {TINY_LIMIT} on the tiny checkpoint)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="requests per generate call")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"default {DEFAULT_MAX_NEW_TOKENS} ({TINY_MAX_NEW_TOKENS} on the tiny checkpoint)",
    )
    p.add_argument(
        "--num-fewshot", type=int, help=f"default {DEFAULT_NUM_FEWSHOT} ({TINY_NUM_FEWSHOT} on the tiny checkpoint)"
    )
    p.add_argument(
        "--seed", type=int, default=DEFAULT_FEWSHOT_SEED, help="few-shot sampling seed (lm-eval's default 1234)"
    )
    p.add_argument(
        "--data", help="folder with test.jsonl and train.jsonl (default: $GSM8K_DIR, ../shared/gsm8k, the hub)"
    )
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default float32 (vllm: bfloat16)")
    p.add_argument("--device", help="torch device (default cuda if available, else cpu)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help="JSON report path (default %(default)s)")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="run two configurations on the same prompts, each a comma-separated list of key=value "
        "overrides of the flags above (keys: " + ", ".join(sorted(OVERRIDE_KEYS)) + "; "
        "planner= and policy= are one key, attention= and backend= another), "
        "e.g. planner=adaptive planner=fixed",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def run(args) -> dict:
    """Everything `main` does except printing: data, prompts, one run or a comparison; the report."""
    tiny = args.checkpoint is None
    limit = args.limit if args.limit is not None else (TINY_LIMIT if tiny else None)
    num_fewshot = (
        args.num_fewshot if args.num_fewshot is not None else (TINY_NUM_FEWSHOT if tiny else DEFAULT_NUM_FEWSHOT)
    )
    max_new_tokens = (
        args.max_new_tokens
        if args.max_new_tokens is not None
        else (TINY_MAX_NEW_TOKENS if tiny else DEFAULT_MAX_NEW_TOKENS)
    )
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected >= 1, got {max_new_tokens}")
    # Check every configuration and find the data before any model or checkpoint work.
    base = RunConfig(
        checkpoint=args.checkpoint or str(TINY_CHECKPOINT_DIR),
        framework=args.framework,
        backend=args.backend,
        policy=args.policy,
        batching=args.batching,
        dtype=args.dtype or ("bfloat16" if args.framework == "vllm" else "float32"),
        device=args.device,
        batch_size=args.batch_size,
    )
    configs = [apply_overrides(base, s) for s in args.compare] if args.compare else [base.resolved()]
    try:
        data = load_gsm8k(args.data)
    except FileNotFoundError as e:
        raise SetupError(str(e)) from None
    if tiny:
        ensure_tiny_checkpoint()
    for cfg in configs:
        if not Path(cfg.checkpoint, "config.json").is_file():
            raise SetupError(f"checkpoint {cfg.checkpoint}: no config.json there")
    prompts = build_prompts(data.test, data.train, num_fewshot=num_fewshot, seed=args.seed, limit=limit)
    header = {
        "task": "gsm8k",
        "lm_eval_task_version": LM_EVAL_TASK_VERSION,
        "data": data.source,
        "num_problems": len(prompts),
        "num_fewshot": num_fewshot,
        "fewshot_seed": args.seed,
        "max_new_tokens": max_new_tokens,
        "stop_strings": list(STOP_STRINGS),
        "tiny_checkpoint": tiny,
    }
    progress = not args.no_progress
    if not args.compare:
        return header | run_config(configs[0], prompts, data.test, max_new_tokens=max_new_tokens, progress=progress)
    a, b = (
        run_config(c, prompts, data.test, max_new_tokens=max_new_tokens, progress=progress, label=f"gsm8k {name}")
        for c, name in zip(configs, "AB")
    )
    return header | {"compare": {"a": args.compare[0], "b": args.compare[1], **compare_runs(a, b)}, "a": a, "b": b}


def summary(report: dict) -> str:
    """A few human-readable lines of a report."""

    def one(name, r):
        acc = "  ".join(
            f"{m} {r['accuracy'][m]['accuracy']:.4f} ({r['accuracy'][m]['correct']}/{r['accuracy'][m]['total']})"
            for m in METRICS
        )
        g = r["config"]["generator"]
        t = r["throughput"]
        rate = lambda ph: f"{t[ph]['tokens_per_s']:.1f}" if t[ph]["tokens_per_s"] else "-"  # noqa: E731
        line = (
            f"{name}{g.get('framework')} backend={g.get('backend')} policy={g.get('policy')} "
            f"batching={g.get('batching')} dtype={g.get('dtype')}: {acc}\n    prefill {rate('prefill')} tok/s, decode {rate('decode')} tok/s"
        )
        if r["planner"]:
            line += f", peak workspace rows {r['planner']['peak_workspace_rows']}"
        return line

    head = f"gsm8k {report['num_problems']} problems, {report['num_fewshot']}-shot, data {report['data']}"
    if "compare" not in report:
        return head + "\n" + one("", report)
    c = report["compare"]
    diff = "  ".join(f"{m} {c['accuracy_difference'][m]:+.4f}" for m in METRICS)
    return "\n".join(
        [
            head,
            one("A: ", report["a"]),
            one("B: ", report["b"]),
            f"identical generated tokens: {c['identical_problems']}/{c['problems']} "
            f"(first difference: {c['first_difference'] and c['first_difference']['doc_id']}); "
            f"accuracy B-A: {diff}",
        ]
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except (SetupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(summary(report))
    if report.get("tiny_checkpoint"):
        print("(tiny random checkpoint: accuracy near zero is expected)")
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
