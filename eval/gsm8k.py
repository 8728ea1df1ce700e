"""GSM8K on a DeepSeek-V4 (or, with --framework jax, V4.1) checkpoint, scored exactly like lm-evaluation-harness's `gsm8k` task.

    python -m eval.gsm8k                                   # tiny random checkpoint, small slice
    python -m eval.gsm8k --checkpoint DIR --attention reference --planner adaptive --output report.json
    python -m eval.gsm8k --checkpoint DIR --compare planner=adaptive planner=fixed
    python -m eval.gsm8k --checkpoint DIR --compare attention=eager attention=reference,batch_size=16
    python -m eval.gsm8k --checkpoint DIR --framework vllm   # vLLM's CPU engine + our plugin (.venv-vllm-cpu)
    python -m eval.gsm8k --checkpoint DIR --framework vllm --compare attention=dsv4 attention=vllm
    python -m eval.gsm8k --checkpoint V41DIR --framework jax  # a DeepSeek-V4.1 checkpoint (JAX model)

`--attention` picks the attention backend (`backend=` of the Python API) and `--planner` the chunk
plan's policy (`policy=`); `--compare` takes either spelling (`planner=` or `policy=`, `attention=`
or `backend=`).

The task itself (prompts, few-shot sampling, filters, scoring, as lm-eval defines them) is
`eval/gsm8k_task.py`.

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
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from eval.generator_base import (
    BATCHING,
    DTYPES,
    Generator,
    SetupError,
    framework_backends,
)
from eval.generators import load_generator
from eval.gsm8k_task import (
    DEFAULT_FEWSHOT_SEED,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_FEWSHOT,
    LM_EVAL_TASK_VERSION,
    METRICS,
    STOP_STRINGS,
    Prompt,
    accuracy,
    build_prompts,
    load_gsm8k,
    reference_answer,
    score_output,
    truncate_at_stop,
)
from planner.contract import POLICIES

FRAMEWORKS = ("torch", "jax", "vllm")

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CHECKPOINT_DIR = REPO_ROOT / "out" / "tiny-ckpt"
DEFAULT_OUTPUT = REPO_ROOT / "out" / "gsm8k-report.json"

# what `python -m eval.gsm8k` with no --checkpoint runs: the tiny random checkpoint, a small slice
# (its eager 5-shot prefill, ~2200 tokens at head_dim 512, takes ~10 s per problem on 2 CPU cores;
# the default torch attention is our sparse path, batched)
TINY_LIMIT = 8
TINY_NUM_FEWSHOT = 1
TINY_MAX_NEW_TOKENS = 32


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
        allowed = framework_backends(self.framework)
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
    if "backend" not in overrides and base.backend not in framework_backends(framework):
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
        help=f"attention backend (backend= in the API); torch: {'/'.join(framework_backends('torch'))} (default "
        f"auto: our sparse path; eager = transformers' own); jax: {'/'.join(framework_backends('jax'))} (default "
        f"auto); vllm: {'/'.join(framework_backends('vllm'))}",
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
