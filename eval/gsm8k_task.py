"""GSM8K as lm-evaluation-harness's `gsm8k` task defines it: data, prompts, filters, scoring
(used by `eval.gsm8k`, which runs it on a checkpoint).

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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
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
