"""GSM8K evaluation (eval/gsm8k.py, eval/generators.py): lm-eval's prompt and scoring, the greedy
driver, compare, the CLI, and transformers' eager model end to end on a tiny in-test model.

The data tests read GSM8K from `../shared/gsm8k` relative to the repo root (or a `shared/gsm8k`
above it, or $GSM8K_DIR) and skip when it is absent; nothing of it is copied into the repo.
"""

import importlib
import importlib.util
import json
import random
import re
import statistics
import sys

import pytest

from eval import generator_base as B
from eval import generators as G
from eval import gsm8k as E
from eval import gsm8k_task as T

ANSWER_18 = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
)


# ----------------------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    "output, strict, flexible",
    [
        (" She makes 9 * 2 = 18 dollars.\n#### 18", "18", "18"),
        (" 16 - 3 - 4 = 9 eggs, 9 * 2 = 18", "[invalid]", "18"),  # flexible: the last number
        (" #### 18 and later 20", "18", "20"),  # strict: the first ####, flexible: the last number
        (" #### 5\n#### 7", "5", "7"),
        (" She makes $18.", "[invalid]", "$18."),  # group 1 keeps $ and the period; normalised later
        (" #### 1,080", "1,080", "1,080"),
        (" #### -3", "-3", "-3"),
        (" it is -3 degrees", "[invalid]", "-3"),
        (" answer 7", "[invalid]", "7"),  # one digit: only group 2 matches
        (" ####18", "[invalid]", "18"),  # strict needs "#### " with the space
        (" #### $18", "[invalid]", "$18"),  # strict's class has no $
        (" #### 18.", "18.", "18."),
        (" I do not know", "[invalid]", "[invalid]"),
        ("", "[invalid]", "[invalid]"),
    ],
)
def test_extractions(output, strict, flexible):
    assert T.extract_strict(output) == strict
    assert T.extract_flexible(output) == flexible


@pytest.mark.parametrize(
    "prediction, answer, correct",
    [
        ("18", ANSWER_18, True),
        ("18.", ANSWER_18, True),  # one trailing period removed
        ("$18", ANSWER_18, True),
        ("$18.", ANSWER_18, True),
        ("18..", ANSWER_18, False),  # only one period
        ("1,080", "... #### 1,080", True),
        ("1080", "... #### 1,080", True),
        ("1,080.00", "... #### 1,080", False),  # no numeric comparison in lm-eval
        ("-3", "x\n#### -3", True),
        ("3", "x\n#### -3", False),
        ("[invalid]", ANSWER_18, False),
        ("17", ANSWER_18, False),
        ("018", ANSWER_18, False),
    ],
)
def test_exact_match(prediction, answer, correct):
    assert T.exact_match(prediction, answer) is correct


def test_normalize_steps_in_lm_eval_order():
    assert T.normalize("a, b $c #### d #### 1,2$.") == "12"  # up to the LAST "#### ", then ",", "$", "."
    assert T.normalize("ABC") == "abc"
    assert T.reference_answer(ANSWER_18) == "18"
    assert T.reference_answer("lines\nwith $5.\n#### 2,125") == "2125"


def test_score_output_both_metrics():
    s = T.score_output(" She makes $18.\nQuestion", ANSWER_18)
    assert s == {
        "extracted": {"strict-match": "[invalid]", "flexible-extract": "$18."},
        "correct": {"strict-match": False, "flexible-extract": True},
    }


def test_truncate_at_stop_first_occurrence_wins():
    stops = T.STOP_STRINGS
    assert T.truncate_at_stop(" 18\n\nQuestion: next", stops) == " 18\n\n"
    assert T.truncate_at_stop("a<|im_end|>b Question: c", stops) == "a"
    assert T.truncate_at_stop("a</s>", stops) == "a"
    assert T.truncate_at_stop("no stop", stops) == "no stop"
    assert T.truncate_at_stop("x<eos>y", ["", "<eos>"]) == "x"  # empty stop strings are ignored


def test_accuracy_and_lm_eval_stderr():
    flags = [True, False, True, True, False, False, True]
    a = T.accuracy(flags)
    assert (a["correct"], a["total"]) == (4, 7)
    assert a["accuracy"] == pytest.approx(4 / 7)
    assert a["stderr"] == pytest.approx(statistics.stdev([float(f) for f in flags]) / 7**0.5)
    assert T.accuracy([True])["stderr"] is None


# ----------------------------------------------------------------------------- prompts

TRAIN = [{"question": f"train q{i}?", "answer": f"step {i}\n#### {i}"} for i in range(40)]
TEST = [{"question": f"test q{i}?", "answer": f"work\n#### {i * 2}"} for i in range(6)]


def test_zero_shot_prompt_exact():
    assert T.build_prompt(TEST[0], []) == "Question: test q0?\nAnswer:"
    assert [p.text for p in T.build_prompts(TEST, TRAIN, num_fewshot=0, limit=2)] == [
        "Question: test q0?\nAnswer:",
        "Question: test q1?\nAnswer:",
    ]


def test_two_shot_prompt_exact():
    text = T.build_prompt(TEST[1], [TRAIN[3], TRAIN[0]])
    assert text == (
        "Question: train q3?\nAnswer: step 3\n#### 3\n\n"
        "Question: train q0?\nAnswer: step 0\n#### 0\n\n"
        "Question: test q1?\nAnswer:"
    )


def lm_eval_sampler(train, num_fewshot, num_docs, seed):
    """lm-eval's ContextSampler as used by gsm8k: one Random(seed), rnd.sample(docs, n) per doc in order."""
    rnd = random.Random(seed)
    return [rnd.sample(list(train), num_fewshot) for _ in range(num_docs)]


def test_fewshot_matches_lm_eval_sampler_and_is_deterministic():
    prompts = T.build_prompts(TEST, TRAIN, num_fewshot=5, seed=1234)
    expected = lm_eval_sampler(TRAIN, 5, len(TEST), 1234)
    for p, shots in zip(prompts, expected):
        assert [TRAIN[j] for j in p.fewshot_ids] == shots
        assert p.text == T.build_prompt(TEST[p.doc_id], shots)
        assert p.text.endswith(f"Question: {TEST[p.doc_id]['question']}\nAnswer:")  # the test question last
        assert p.text.count("Question:") == 6 and p.text.count("\n\n") == 5
    assert len({p.fewshot_ids for p in prompts}) > 1  # one generator for all docs: examples differ per doc
    again = T.build_prompts(TEST, TRAIN, num_fewshot=5, seed=1234, limit=3)
    assert [p.text for p in again] == [p.text for p in prompts[:3]]  # --limit keeps each doc's examples
    other = T.build_prompts(TEST, TRAIN, num_fewshot=5, seed=7)
    assert [p.fewshot_ids for p in other] != [p.fewshot_ids for p in prompts]
    assert all(p.prompt_id == T.Prompt(p.doc_id, p.text, p.fewshot_ids).prompt_id for p in prompts)
    assert len({p.prompt_id for p in prompts}) == len(prompts)


def test_prompt_arguments_are_checked():
    with pytest.raises(ValueError, match="num_fewshot"):
        T.build_prompts(TEST, TRAIN[:3], num_fewshot=5)
    with pytest.raises(ValueError, match="num_fewshot"):
        T.build_prompts(TEST, TRAIN, num_fewshot=-1)
    with pytest.raises(ValueError, match="limit"):
        T.build_prompts(TEST, TRAIN, limit=0)
    assert len(T.build_prompts(TEST, TRAIN, limit=100)) == len(TEST)


# ----------------------------------------------------------------------------- data


def shared_gsm8k():
    for _, d in T.data_dir_candidates():
        if (d / "test.jsonl").is_file() and (d / "train.jsonl").is_file():
            return d
    pytest.skip(
        "GSM8K data absent: expected test.jsonl/train.jsonl in ../shared/gsm8k relative to the repo root "
        "(or a shared/gsm8k above it, or $GSM8K_DIR)"
    )


def test_load_shared_gsm8k_and_score_gold_answers():
    d = shared_gsm8k()
    data = T.load_gsm8k()
    assert data.source == str(d.resolve())
    assert (len(data.test), len(data.train)) == (1319, 7473)
    assert data.test[0]["question"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert data.train[0]["question"].startswith("Natalia sold clips to 48 of her friends")
    assert T.reference_answer(data.test[0]["answer"]) == "18"
    assert all(re.fullmatch(r"-?[0-9.]+", T.reference_answer(doc["answer"])) for doc in data.test)
    # The gold answer text, scored as an output, is right under both extractions.
    for doc in data.test:
        assert T.score_output(doc["answer"], doc["answer"])["correct"] == {m: True for m in T.METRICS}
    # lm-eval's default 5-shot examples of test doc 0 (seed 1234): regression pin of the sampler.
    first = T.build_prompts(data.test, data.train, num_fewshot=5, limit=1)[0]
    assert list(first.fewshot_ids) == [6374, 3610, 957, 61, 742]
    assert T.load_gsm8k(d).test == data.test  # --data DIR gives the same


def write_split(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))


def test_load_from_dir_and_errors(tmp_path, monkeypatch):
    write_split(tmp_path / "test.jsonl", TEST)
    write_split(tmp_path / "train.jsonl", TRAIN)
    data = T.load_gsm8k(tmp_path)
    assert data.test == TEST and data.train == TRAIN
    (tmp_path / "bad").mkdir()
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        write_split(tmp_path / "bad" / "test.jsonl", TEST)
        T.load_gsm8k(tmp_path / "bad")
    (tmp_path / "bad" / "train.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"train.jsonl:1: expected an object with 'question' and 'answer'"):
        T.load_gsm8k(tmp_path / "bad")
    (tmp_path / "bad" / "train.jsonl").write_text('{"question": "q", "answer": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"train.jsonl:2: not JSON"):
        T.load_gsm8k(tmp_path / "bad")
    # Nothing anywhere and no `datasets`: one error naming every place tried.
    monkeypatch.setattr(T, "data_dir_candidates", lambda: [("shared folder", tmp_path / "nowhere")])
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(FileNotFoundError, match=r"nowhere.*`datasets` package is not installed.*--data DIR"):
        T.load_gsm8k()


# ----------------------------------------------------------------------------- greedy driver on fakes


class CharCodec:
    """One token per character (id = code point); ids 1 (EOS) and 2 (pad) are special."""

    eos_token_ids = frozenset({1})
    pad_token_id = 2
    eos_text = "<eos>"

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i not in (1, 2))


class ScriptedGenerator(B.Generator):
    """Returns a scripted continuation per prompt (keyed by the prompt's last question), then EOS.

    Checks the driver's contract: decode gets exactly one token per session row, the pad id for
    finished rows. `plans`: report a planner StepPlan for every prefill."""

    def __init__(self, scripts, batching="per_request", plans=False):
        super().__init__()
        self.codec, self.scripts, self.batching, self.plans = CharCodec(), scripts, batching, plans
        self.sessions = []

    def _script(self, prompt):
        question = self.codec.decode(prompt).rsplit("Question: ", 1)[-1]
        return [ord(c) for c in self.scripts.get(question, "")] + [1]

    def prefill(self, prompts):
        self.rows = [self._script(p) for p in prompts]
        self.pos, self.lens = [0] * len(prompts), [len(p) for p in prompts]
        self.done = [False] * len(prompts)
        self.sessions.append(len(prompts))
        return [r[0] for r in self.rows]

    def decode(self, tokens):
        assert len(tokens) == len(self.rows)
        out = []
        for j, t in enumerate(tokens):
            row = self.rows[j]
            if t == self.codec.pad_token_id:  # the driver finished this row; it stays finished
                self.done[j] = True
            else:
                assert not self.done[j] and t == row[self.pos[j]]  # fed back what we returned
                self.pos[j] += 1
            out.append(row[min(self.pos[j], len(row) - 1)])
        return out

    def last_plan(self):  # a plan after each prefill, none after decode steps
        if not self.plans or self.pos != [0] * len(self.pos):
            return None
        import planner as P

        cfg = P.PlanConfig(window_size=8, max_model_len=4096, max_num_batched_tokens=256)
        return P.plan_step(P.PrefillBatch(self.lens, self.lens), cfg)


SCRIPTS = {
    "test q0?\nAnswer:": " 2 * 0 = 0\n#### 0\n\nQuestion: more",  # right, then a stop string
    "test q1?\nAnswer:": " It is $2.",  # flexible only, ends with EOS
    "test q2?\nAnswer:": " #### 5 then a very long tail that never stops",  # wrong, hits max_new_tokens
}


@pytest.mark.parametrize("batching", ["per_request", "batched"])
def test_driver_stops_on_stop_string_eos_and_length(batching):
    gen = ScriptedGenerator(SCRIPTS, batching)
    prompts = [p for p in T.build_prompts(TEST, TRAIN, num_fewshot=1, limit=3)]
    ids = [gen.codec.encode(p.text) for p in prompts]
    out = gen.generate(ids, 40, T.STOP_STRINGS)
    texts = [gen.codec.decode(o) for o in out]
    assert texts[0] == " 2 * 0 = 0\n#### 0\n\nQuestion:"  # stops on the token completing "Question:"
    assert out[1][-1] == 1 and texts[1] == " It is $2."  # EOS ends the request, and is kept
    assert len(out[2]) == 40
    assert gen.sessions == ([1, 1, 1] if batching == "per_request" else [3])
    prefill = [s for s in gen.steps if s.phase == "prefill"]
    decode = [s for s in gen.steps if s.phase == "decode"]
    assert sum(s.tokens for s in prefill) == sum(map(len, ids))
    assert sum(s.tokens for s in decode) == sum(map(len, out)) - len(out)  # the first token comes from prefill
    assert all(s.chunks is None and s.peak_workspace_rows is None for s in gen.steps)


def test_driver_rejects_bad_input():
    gen = ScriptedGenerator({})
    with pytest.raises(ValueError, match="prompts"):
        gen.generate([], 4, [])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        gen.generate([[5], []], 4, [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate([[5]], 0, [])
    with pytest.raises(TypeError, match="stop_strings"):
        gen.generate([[5]], 3, "Question:")


def test_evaluate_report_from_scripted_outputs():
    prompts = T.build_prompts(TEST, TRAIN, num_fewshot=2, limit=3)
    report = E.evaluate(ScriptedGenerator(SCRIPTS), prompts, TEST, batch_size=2, max_new_tokens=40, progress=False)
    p0, p1, p2 = report["problems"]
    assert (p0["output"], p0["stopped_by"], p0["correct"]) == (
        " 2 * 0 = 0\n#### 0\n\n",
        "stop_string",
        {"strict-match": True, "flexible-extract": True},
    )
    assert (p1["output"], p1["stopped_by"], p1["extracted"]["flexible-extract"], p1["correct"]) == (
        " It is $2.",
        "eos",
        "$2.",
        {"strict-match": False, "flexible-extract": True},
    )
    assert (p2["stopped_by"], p2["extracted"]["strict-match"], p2["target"]) == ("max_new_tokens", "5", "4")
    assert [p["fewshot_ids"] for p in report["problems"]] == [list(p.fewshot_ids) for p in prompts]
    assert report["accuracy"]["strict-match"]["correct"] == 1
    assert report["accuracy"]["flexible-extract"]["correct"] == 2
    assert report["throughput"]["prefill"]["tokens"] == sum(p["prompt_tokens"] for p in report["problems"])
    assert report["planner"] is None


def test_evaluate_planner_figures_from_the_stats_hook():
    import planner as P

    prompts = T.build_prompts(TEST, TRAIN, num_fewshot=1, limit=4)
    gen = ScriptedGenerator(SCRIPTS, "batched", plans=True)
    report = E.evaluate(gen, prompts, TEST, batch_size=2, max_new_tokens=4, progress=False)
    lens = [p["prompt_tokens"] for p in report["problems"]]
    cfg = P.PlanConfig(window_size=8, max_model_len=4096, max_num_batched_tokens=256)
    expected = [P.plan_step(P.PrefillBatch(lens[i : i + 2], lens[i : i + 2]), cfg) for i in (0, 2)]
    steps = report["planner"]["prefill_steps"]
    assert [s["chunks"] for s in steps] == [{k.name: kp.num_chunks for k, kp in e.kinds.items()} for e in expected]
    assert [s["peak_workspace_rows"] for s in steps] == [e.max_workspace_rows for e in expected]
    assert report["planner"]["peak_workspace_rows"]["prefill"] == max(e.max_workspace_rows for e in expected)
    assert report["planner"]["chunks_per_prefill_step"]["CSA"]["max"] == max(e["CSA"].num_chunks for e in expected)


def test_plan_figures_inputs():
    import planner as P

    step = P.plan_step(
        P.PrefillBatch([300, 40], [300, 40]),
        P.PlanConfig(window_size=8, max_model_len=512, max_num_batched_tokens=512, policy="fixed"),
    )
    chunks, peak = B.plan_figures(step)
    assert chunks == {k.name: step[k].num_chunks for k in P.LayerKind} and chunks["CSA"] == step["CSA"].num_chunks
    assert peak == step.max_workspace_rows > 0
    assert B.plan_figures(type("Meta", (), {"step_plan": step})()) == (chunks, peak)
    assert B.plan_figures({"chunks": {"CSA": 2}, "peak_workspace_rows": 9}) == ({"CSA": 2}, 9)
    assert B.plan_figures(None) == (None, None)
    with pytest.raises(TypeError, match="plan"):
        B.plan_figures(42)
    # DeepSeek-V4.1: one figure per plan (ratio, band) of the schedule
    v41 = P.plan_step(
        P.PrefillBatch([300, 40], [300, 40]),
        P.PlanConfig(window_size=16, max_model_len=512, max_num_batched_tokens=512, replay=None),
        P.Schedule.from_name("V4.1-tiny"),
    )
    chunks, peak = B.plan_figures(v41)
    assert set(chunks) == {"SWA/full", "CSA2/full", "CSA1/cut", "CSA1/replay"} and peak == v41.max_workspace_rows


def test_v41_checkpoints_run_on_the_jax_framework_only(tmp_path):
    from planner.contract import preset

    (tmp_path / "config.json").write_text(json.dumps(preset("V4.1-tiny")))
    with pytest.raises(ValueError, match=r"DeepSeek-V4.1 checkpoint, which runs with framework='jax'"):
        G.load_generator(tmp_path, framework="torch")


# ----------------------------------------------------------------------------- compare


def test_compare_runs_agreement_first_difference_and_flips():
    prompts = T.build_prompts(TEST, TRAIN, num_fewshot=1, limit=3)
    a = E.evaluate(ScriptedGenerator(SCRIPTS), prompts, TEST, max_new_tokens=40, progress=False)
    changed = dict(SCRIPTS, **{"test q1?\nAnswer:": " It is $3."})
    b = E.evaluate(ScriptedGenerator(changed, "batched"), prompts, TEST, max_new_tokens=40, progress=False)
    same = E.compare_runs(a, a)
    assert (same["token_agreement"], same["first_difference"]) == (1.0, None)
    c = E.compare_runs(a, b)
    assert (c["problems"], c["identical_problems"]) == (3, 2)
    assert c["token_agreement"] == pytest.approx(2 / 3)
    first = c["first_difference"]
    assert (first["doc_id"], first["token_index"]) == (1, len(" It is $"))
    assert (chr(first["a_tokens"][0]), chr(first["b_tokens"][0])) == ("2", "3")
    assert c["accuracy_difference"] == {"strict-match": 0.0, "flexible-extract": pytest.approx(-1 / 3)}
    assert c["correctness_flips"] == {"strict-match": [], "flexible-extract": [1]}
    other = E.evaluate(
        ScriptedGenerator(SCRIPTS),
        T.build_prompts(TEST, TRAIN, num_fewshot=0, limit=3),
        TEST,
        max_new_tokens=4,
        progress=False,
    )
    with pytest.raises(ValueError, match="different prompts"):
        E.compare_runs(a, other)


def test_parse_and_apply_overrides():
    # the CLI flags' spellings (planner=, attention=) and the API's (policy=, backend=) are one key each
    want = {"policy": "fixed", "backend": "reference"}
    assert E.parse_overrides("planner=fixed, attention=reference") == want
    assert E.parse_overrides("policy=fixed,backend=reference") == want
    assert E.parse_overrides("planner=fixed,backend=reference") == want
    assert E.parse_overrides("batch_size=16") == {"batch_size": 16}
    assert E.parse_overrides("") == {}
    for bad, msg in [
        ("planner", "key=value"),
        ("color=red", "unknown key 'color'.*attention.*planner"),
        ("planner=a,planner=b", "twice"),
        ("planner=a,policy=b", "'policy / planner' given twice"),
        ("attention=eager,backend=xla", "'backend / attention' given twice"),
        ("batch_size=x", "batch_size must be an integer"),
    ]:
        with pytest.raises(ValueError, match=msg):
            E.parse_overrides(bad)
    base = E.RunConfig(checkpoint="ckpt")
    assert base.resolved().backend == "auto"  # torch: our sparse path
    assert E.apply_overrides(base, "framework=jax").backend == "auto"
    ref = E.RunConfig(checkpoint="ckpt", backend="reference")
    assert E.apply_overrides(ref, "framework=torch").backend == "reference"  # kept where it exists
    assert E.apply_overrides(ref, "framework=jax").backend == "auto"
    for spec in ("attention=reference,planner=fixed", "backend=reference,policy=fixed"):
        assert E.apply_overrides(base, spec) == E.RunConfig(checkpoint="ckpt", backend="reference", policy="fixed")
    with pytest.raises(ValueError, match=r"backend \(--attention\): for framework=jax"):
        E.apply_overrides(base, "framework=jax,attention=eager")
    with pytest.raises(ValueError, match=r"policy \(--planner\)"):
        E.apply_overrides(base, "planner=greedy")
    with pytest.raises(ValueError, match="batch_size"):
        E.apply_overrides(base, "batch_size=0")


def test_cli_flags_map_onto_backend_and_policy(capsys):
    args = E.parse_args(["--attention", "xla", "--planner", "fixed", "--framework", "jax"])
    assert (args.backend, args.policy, args.framework) == ("xla", "fixed", "jax")
    assert (E.parse_args([]).backend, E.parse_args([]).policy) == (None, "adaptive")
    with pytest.raises(SystemExit):
        E.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "planner= and policy= are one key, attention= and backend= another" in text
    assert "backend= in the API" in text and "policy= in the API" in text


def test_cli_compare_writes_report(tmp_path, monkeypatch, capsys):
    """main() end to end with scripted generators standing in for the models."""
    write_split(tmp_path / "test.jsonl", TEST)
    write_split(tmp_path / "train.jsonl", TRAIN)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    loaded = []

    def fake_load(checkpoint, **cfg):
        loaded.append(cfg)
        scripts = SCRIPTS if cfg["policy"] == "adaptive" else dict(SCRIPTS, **{"test q0?\nAnswer:": " #### 1"})
        return ScriptedGenerator(scripts, "batched" if cfg["backend"] != "eager" else "per_request")

    monkeypatch.setattr(E, "load_generator", fake_load)
    out = tmp_path / "r.json"
    argv = [
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--data",
        str(tmp_path),
        "--limit",
        "3",
        "--num-fewshot",
        "2",
        "--max-new-tokens",
        "40",
        "--output",
        str(out),
        "--no-progress",
        "--compare",
        "attention=reference,planner=adaptive",
        "backend=reference,policy=fixed",
    ]
    assert E.main(argv) == 0
    assert [(c["backend"], c["policy"]) for c in loaded] == [("reference", "adaptive"), ("reference", "fixed")]
    report = json.loads(out.read_text())
    assert report["num_problems"] == 3 and report["num_fewshot"] == 2 and report["fewshot_seed"] == 1234
    assert report["compare"]["identical_problems"] == 2
    assert report["compare"]["first_difference"]["doc_id"] == 0
    assert report["compare"]["accuracy_difference"]["strict-match"] == pytest.approx(-1 / 3)
    assert report["a"]["config"]["policy"] == "adaptive" and report["b"]["config"]["policy"] == "fixed"
    assert "identical generated tokens: 2/3" in capsys.readouterr().out
    # A bad spec or missing data fails before any model is loaded, with a message and exit code 2.
    loaded.clear()
    assert E.main(argv[:-2] + ["planner=x", "planner=fixed"]) == 2
    assert E.main(["--checkpoint", str(tmp_path / "ckpt"), "--data", str(tmp_path / "none"), "--output", str(out)]) == 2
    assert loaded == [] and "error: --data" in capsys.readouterr().err


def has_module(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_missing_components_fail_clearly(tmp_path):
    """Until issue 7 lands here, its absence is a clear SetupError (each check runs only then)."""
    if not has_module("dsv4_jax.model"):
        with pytest.raises(B.SetupError, match=r"JAX DeepSeek-V4 model \(issue 7\)"):
            G.load_generator(tmp_path, framework="jax", backend="auto")
    if not has_module("tools.tiny_checkpoint"):
        with pytest.raises(B.SetupError, match=r"tiny checkpoint writer"):
            E.ensure_tiny_checkpoint(tmp_path / "tiny")
    with pytest.raises(ValueError, match="backend: for framework='torch'"):
        G.load_generator(tmp_path, backend="triton-jax")
    with pytest.raises(ValueError, match="backend: for framework='jax'"):
        G.load_generator(tmp_path, framework="jax", backend="eager")
    with pytest.raises(ValueError, match="policy: expected one of"):
        G.load_generator(tmp_path, policy="greedy")
    with pytest.raises(ValueError, match="batching='batched' with backend='eager'"):
        B.resolve_batching("batched", "eager")
    assert B.resolve_batching("auto", "eager") == "per_request"
    assert B.resolve_batching("auto", "reference") == "batched"


# ----------------------------------------------------------------------------- transformers eager, tiny model


@pytest.fixture(scope="module")
def tiny_eager(tmp_path_factory):
    """A tiny random DeepSeek-V4 (layers SWA, CSA, HCA; 16 indexer heads) and a byte-level tokenizer
    with <bos>/<eos>/<pad>, saved as a checkpoint directory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>", "<pad>"])  # ids 256, 257, 258
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 256)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    cfg = transformers.DeepseekV4Config(
        vocab_size=260,
        hidden_size=32,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=32,
        partial_rotary_factor=0.25,
        o_groups=2,
        o_lora_rank=16,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=4,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():  # init leaves these at zero; give them real values
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_()
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape))
    ckpt = tmp_path_factory.mktemp("tiny-eager")
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: 1 thread is faster, and CI runs 2 test workers on 2 cores
    yield model, ckpt
    torch.set_num_threads(threads)


def test_eager_greedy_loop_equals_generate(tiny_eager):
    import torch

    model, ckpt = tiny_eager
    gen = G.load_generator(ckpt, backend="eager", device="cpu")
    assert isinstance(gen, G.TorchEvalGenerator) and gen.batching == "per_request"
    prompts = [
        gen.codec.encode("Question: " + "Tom has 12 apples and buys 30 more. " * 4 + "\nAnswer:"),
        gen.codec.encode("Question: 2+2?\nAnswer:"),
    ]
    assert prompts[0][0] == 256 and len(prompts[0]) > 128  # BOS added; long enough for an HCA entry
    out = gen.generate(prompts, 6, [])
    for p, o in zip(prompts, out):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p) :].tolist()
        assert o == ref  # both stop after an EOS (257) or 6 tokens


def test_eager_left_padding_changes_logits(tiny_eager):
    """Why eager runs per request: a left-padded request gets other logits than alone."""
    import torch

    model, _ = tiny_eager
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 256, (150,), generator=g).tolist(), torch.randint(0, 256, (137,), generator=g).tolist()
    pad = [258] * (len(a) - len(b))
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([b])).logits[0, -1]
        mask = torch.tensor([[1] * len(a), [0] * len(pad) + [1] * len(b)])
        padded = model(
            input_ids=torch.tensor([a, pad + b]), attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits[1, -1]
    assert (alone - padded).abs().max() > 1e-3


def test_cli_end_to_end_on_tiny_eager_checkpoint(tiny_eager, tmp_path):
    _, ckpt = tiny_eager
    write_split(tmp_path / "test.jsonl", TEST)
    write_split(tmp_path / "train.jsonl", TRAIN)
    out = tmp_path / "r.json"
    argv = [
        "--checkpoint",
        str(ckpt),
        "--data",
        str(tmp_path),
        "--limit",
        "2",
        "--num-fewshot",
        "1",
        "--max-new-tokens",
        "3",
        "--batch-size",
        "2",
        "--output",
        str(out),
        "--no-progress",
        "--attention",
        "eager",
    ]
    assert E.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["config"]["generator"]["batching"] == "per_request"
    assert report["config"]["generator"]["backend"] == "eager" and report["config"]["backend"] == "eager"
    assert report["planner"] is None
    for p in report["problems"]:
        assert 1 <= len(p["generated_token_ids"]) <= 3
        assert p["prompt_tokens"] == len(T.build_prompts(TEST, TRAIN, num_fewshot=1, limit=2)[p["doc_id"]].text) + 1
    t = report["throughput"]
    assert t["prefill"]["calls"] == 2 and t["prefill"]["tokens_per_s"] > 0


def test_batched_adapter_path_on_equal_lengths(tiny_eager):
    """The batched path (mask, per-row positions, growing mask) on prompts of one length, where eager
    needs no padding: same tokens as per request. Ragged batches need our attention (issue 6)."""
    _, ckpt = tiny_eager
    gen = G.load_generator(ckpt, backend="eager", device="cpu")
    prompts = [gen.codec.encode(f"Question: {a} + {b} = ?\nAnswer:") for a, b in ((12, 30), (45, 11), (70, 99))]
    assert len({len(p) for p in prompts}) == 1
    alone = gen.generate(prompts, 5, [])
    gen.batching = "batched"  # bypasses resolve_batching's guard, fine without padding
    assert gen.generate(prompts, 5, []) == alone
    assert [s.requests for s in gen.steps if s.phase == "prefill"][-1] == 3


def test_cli_compare_eager_vs_our_ragged_batches(tiny_eager, tmp_path):
    """`--compare attention=eager attention=reference`: eager one request at a time vs our path on
    left-padded ragged batches (prompts from 20 to 170 tokens: CSA top-k and HCA entries in use)
    give identical tokens, and the report carries our planner figures and the backend that ran."""
    _, ckpt = tiny_eager
    test = [{"question": "Tom has 3 apples. " * n + "How many?", "answer": "#### 3"} for n in (9, 1, 4, 0)]
    write_split(tmp_path / "test.jsonl", test)
    write_split(tmp_path / "train.jsonl", TRAIN)
    out = tmp_path / "r.json"
    argv = [
        "--checkpoint",
        str(ckpt),
        "--data",
        str(tmp_path),
        "--num-fewshot",
        "0",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "4",
        "--output",
        str(out),
        "--no-progress",
        "--compare",
        "attention=eager",
        "attention=reference",
    ]
    assert E.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["compare"]["problems"] == 4 and report["compare"]["identical_problems"] == 4
    gen_a, gen_b = report["a"]["config"]["generator"], report["b"]["config"]["generator"]
    assert gen_a["batching"] == "per_request" and gen_b["batching"] == "batched"
    assert gen_b["backends"] == {"SWA": "reference", "CSA": "reference", "HCA": "reference"}
    lengths = sorted(p["prompt_tokens"] for p in report["b"]["problems"])
    assert lengths[0] < 32 and lengths[-1] > 128
    assert report["a"]["planner"] is None and report["b"]["planner"] is not None


def test_cli_compare_torch_vs_jax(tiny_eager, tmp_path):
    """`--compare framework=torch framework=jax`: both frameworks' models, each on its own ragged
    batched path, generate identical tokens for prompts of 20 to 170 tokens."""
    pytest.importorskip("jax")
    _, ckpt = tiny_eager
    test = [{"question": "Tom has 3 apples. " * n + "How many?", "answer": "#### 3"} for n in (9, 1, 4)]
    write_split(tmp_path / "test.jsonl", test)
    write_split(tmp_path / "train.jsonl", TRAIN)
    out = tmp_path / "r.json"
    argv = [
        "--checkpoint",
        str(ckpt),
        "--data",
        str(tmp_path),
        "--num-fewshot",
        "0",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "3",
        "--output",
        str(out),
        "--no-progress",
        "--compare",
        "framework=torch,attention=reference",
        "framework=jax,attention=xla",
    ]
    assert E.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["compare"]["problems"] == 3 and report["compare"]["identical_problems"] == 3
    assert report["b"]["planner"] is not None
    gen_a, gen_b = report["a"]["config"]["generator"], report["b"]["config"]["generator"]
    assert (gen_a["generator"], gen_b["generator"]) == ("TorchEvalGenerator", "JaxEvalGenerator")
    assert (gen_a["backend"], gen_b["backend"], gen_b["policy"]) == ("reference", "xla", "adaptive")
