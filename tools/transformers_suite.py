"""transformers' own DeepSeek-V4 model tests, run on plain transformers and through our path.

    python -m tools.transformers_suite [--full] [--backend reference] [--json out/suite.json]

Runs `tests/models/deepseek_v4/test_modeling_deepseek_v4.py` of the installed transformers'
version twice in pytest subprocesses (`tools/suite_plugin.py`): once as it is ("plain"), once with
every DeepSeek-V4 model routed through `dsv4_torch.hf.enable_sparse_prefill` ("ours"), and
compares the outcomes test by test. A regression is a test that passes on plain transformers and
does not pass on ours, except the tests that ask for `output_attentions` (`EXPECTED_REFUSALS`),
which must then fail with our clear refusal. Without --full only `CI_SELECTION` runs (the tests
that exercise the attention: forwards, batching, dtypes, training, checkpointing, saving).

The test tree (transformers' files, Apache-2.0; none of them is committed here) is assembled once
under `out/transformers-suite/<version>/` (git-ignored) from:
  1. `$DSV4_TRANSFORMERS_TESTS`, if set: a transformers checkout of that version, or its `tests/`
     directory, or just the files the sdist lacks; its files win;
  2. GitHub at tag v<version> (a sparse `git clone` of tests/), where GitHub can be reached;
  3. the version's source distribution from PyPI (`pip download --no-binary :all: --no-deps`),
     for `tests/test_modeling_common.py` and the other top-level test modules, when 1 and 2 lack
     them. The sdist has no `tests/models/`, `tests/causal_lm_tester.py`, `tests/generation/`,
     `tests/exporters/` or `tests/utils/`.
Without the DeepSeek-V4 test file, `causal_lm_tester.py` or `utils/test_configuration_utils.py`,
`assemble` raises `SuiteUnavailable` (before any download) saying what is missing and how to
provide it. Where only the generation or export mixin modules are missing, placeholders stand in
(those mixins' tests do not run) and the report lists them (`placeholders`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "out" / "transformers-suite"
TEST_FILE = "tests/models/deepseek_v4/test_modeling_deepseek_v4.py"
# Not in the PyPI sdist (which has tests/test_modeling_common.py and the other top-level modules).
GITHUB_ONLY = (TEST_FILE, "tests/causal_lm_tester.py", "tests/utils/test_configuration_utils.py")
PLACEHOLDER_MARK = "# dsv4 suite placeholder"
PLACEHOLDERS = {
    "tests/generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "tests/exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
}
# The tests that ask for output_attentions: dense attention weights are what the sparse path avoids.
EXPECTED_REFUSALS = {
    "test_attention_outputs",
    "test_model_outputs_equivalence",
    "test_retain_grad_hidden_states_attentions",
    "test_capture_outputs_decorator",
}
REFUSAL_MESSAGE = "output_attentions: not available with the sparse prefill path"
# What CI runs (pytest -k; --full / DSV4_SUITE_FULL=1: everything): training and the three
# checkpointing variants, a 16-bit cast, batching, determinism, embeddings, a refusal; left out
# are the slowest forward tests (fp32/fp16 batched-vs-grouped, save/load, chunking) and the tests
# that only build, save or inspect models.
CI_SELECTION = " or ".join(
    (
        "test_training",
        "test_eager_matches_batched_and_grouped_inference_2_bf16",
        "test_batching_equivalence",
        "test_determinism",
        "test_inputs_embeds_matches_input_ids",
        "test_resize_tokens_embeddings",
        "test_hidden_states_output",
        "test_attention_outputs",
        "test_causal_lm_can_accept_training_kwargs",
    )
)


class SuiteUnavailable(RuntimeError):
    """transformers' test files cannot be had here; the message says what is missing and why."""


@dataclass
class Tree:
    root: Path  # holds tests/ and src/transformers
    version: str
    sources: list[str]
    placeholders: list[str] = field(default_factory=list)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def assemble(version: str | None = None, cache: Path = CACHE, log=print) -> Tree:
    """The test tree for `version` (default: the installed transformers'), built once and cached."""
    version = version or transformers_version()
    root = cache / version
    manifest = root / "MANIFEST.json"
    local = os.environ.get("DSV4_TRANSFORMERS_TESTS")
    if manifest.exists() and not local:
        info = json.loads(manifest.read_text())
        return Tree(root, version, info["sources"], info["placeholders"])
    work = Path(tempfile.mkdtemp(prefix="tree-", dir=_mkdir(cache)))
    try:
        return _assemble(version, root, work, local, cache, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _assemble(version, root: Path, work: Path, local, cache: Path, log) -> Tree:
    tests = work / "tests"
    overlays, sources, reasons = [], [], []  # test trees whose files win over the sdist's
    if local:
        src = Path(local)
        src = src / "tests" if (src / "tests").is_dir() else src
        if not src.is_dir() or not any(src.iterdir()):
            raise SuiteUnavailable(f"DSV4_TRANSFORMERS_TESTS={local!r}: no transformers tests/ directory there")
        overlays.append(src)
        sources.append(f"DSV4_TRANSFORMERS_TESTS={local}")

    def have(rel):
        return any((o / rel.removeprefix("tests/")).exists() for o in overlays)

    if not all(have(f) for f in GITHUB_ONLY):
        try:
            overlays.append(_github_tests(version, work, log))
            sources.append(f"github.com/huggingface/transformers v{version}")
        except SuiteUnavailable as e:
            reasons.append(str(e))
    missing = [f for f in GITHUB_ONLY if not have(f)]
    if missing:
        raise SuiteUnavailable(
            f"transformers {version}'s {', '.join(missing)} are not in its PyPI sdist and not available here ("
            + "; ".join(reasons or ["not found in DSV4_TRANSFORMERS_TESTS"])
            + f"): set DSV4_TRANSFORMERS_TESTS to a transformers checkout of v{version} (or its tests/ directory)"
        )
    if not have("tests/test_modeling_common.py"):  # the top-level test modules: from the sdist
        shutil.copytree(_sdist_tests(version, cache, log), tests)
        sources.insert(0, f"PyPI sdist transformers=={version}")
    for o in overlays:
        shutil.copytree(o, tests, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    placeholders = []
    for rel, text in PLACEHOLDERS.items():
        path = work / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{PLACEHOLDER_MARK}: transformers' {rel} was not available\n{text}")
        if path.read_text().startswith(PLACEHOLDER_MARK):
            placeholders.append(rel)
    for d in (
        "tests",
        "tests/models",
        "tests/models/deepseek_v4",
        "tests/generation",
        "tests/exporters",
        "tests/utils",
    ):
        (work / d).mkdir(parents=True, exist_ok=True)
        (work / d / "__init__.py").touch()
    summary = tests / "utils" / "tiny_model_summary.json"
    if not summary.exists():  # read by the pipeline mixin at import; DeepSeek-V4 skips pipeline tests
        summary.write_text("{}\n")
    import transformers

    (work / "src").mkdir(exist_ok=True)
    (work / "src" / "transformers").symlink_to(Path(transformers.__file__).parent)
    (work / "MANIFEST.json").write_text(json.dumps({"sources": sources, "placeholders": placeholders}, indent=1))
    shutil.rmtree(work / "github", ignore_errors=True)
    if root.exists():
        shutil.rmtree(root)
    work.rename(root)
    return Tree(root, version, sources, placeholders)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _sdist_tests(version: str, cache: Path, log) -> Path:
    out = cache / f"sdist-{version}"
    tests = out / f"transformers-{version}" / "tests"
    if tests.is_dir():
        return tests
    _mkdir(out)
    tarball = out / f"transformers-{version}.tar.gz"
    if not tarball.exists():
        log(f"transformers suite: pip download transformers=={version} (sdist)")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            f"transformers=={version}",
            "-d",
            str(out),
        ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SuiteUnavailable(f"pip download of the sdist failed ({e})") from e
        if r.returncode != 0 or not tarball.exists():
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
            raise SuiteUnavailable(f"pip download of the sdist failed: {tail[0]}")
    prefix = f"transformers-{version}/tests/"
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        tar.extractall(out, members=members, filter="data")
    return tests


def _github_tests(version: str, work: Path, log) -> Path:
    if shutil.which("git") is None:
        raise SuiteUnavailable("git is not installed (needed to fetch the test files from GitHub)")
    dest = work / "github"
    log(f"transformers suite: git clone (sparse) huggingface/transformers v{version} tests/")
    steps = [
        [
            "git",
            "clone",
            "--quiet",
            "--depth",
            "1",
            "--branch",
            f"v{version}",
            "--filter=blob:none",
            "--sparse",
            "https://github.com/huggingface/transformers.git",
            str(dest),
        ],
        [
            "git",
            "-C",
            str(dest),
            "sparse-checkout",
            "set",
            "tests/models/deepseek_v4",
            "tests/generation",
            "tests/exporters",
            "tests/utils",
        ],
    ]
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    for cmd in steps:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SuiteUnavailable(f"GitHub cannot be reached ({e})") from e
        if r.returncode != 0:
            tail = r.stderr.strip().splitlines()[-1:] or [""]
            raise SuiteUnavailable(f"GitHub cannot be reached: {tail[0]}")
    return dest / "tests"


# ----------------------------------------------------------------------------- running


@dataclass
class Run:
    mode: str
    tests: dict[str, dict]  # test name -> {"outcome", "message"}
    models_enabled: int
    sparse_layer_calls: int
    returncode: int
    seconds: float

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.tests.values() if r["outcome"] == outcome)


def ensure_test_dependencies(cache: Path = CACHE, log=print) -> list[str]:
    """Extra import paths for what transformers' tests import beyond our test extra
    (`parameterized`): installed into the cache with pip if this environment lacks it."""
    try:
        import parameterized  # noqa: F401

        return []
    except ImportError:
        pass
    target = cache / "pydeps"
    if not (target / "parameterized").is_dir():
        log("transformers suite: pip install parameterized (into the cache)")
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(target), "parameterized"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode != 0:
            raise SuiteUnavailable(f"cannot install parameterized: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return [str(target)]


def run(
    tree: Tree,
    mode: str,
    *,
    backend: str = "reference",
    select: str | None = CI_SELECTION,
    extra_paths=(),
    timeout: int = 3600,
) -> Run:
    """One pytest run of the DeepSeek-V4 model tests in a subprocess ("plain" or "ours")."""
    import time

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        report = f.name
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *extra_paths, os.environ.get("PYTHONPATH", "")]),
        "DSV4_SUITE_MODE": mode,
        "DSV4_SUITE_BACKEND": backend,
        "DSV4_SUITE_REPORT": report,
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        os.devnull,
        "--rootdir",
        str(tree.root),
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "tools.suite_plugin",
        "-W",
        "ignore::pytest.PytestUnknownMarkWarning",
        TEST_FILE,
    ]
    if select:
        cmd += ["-k", select]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree.root, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    try:
        data = json.loads(Path(report).read_text() or "{}")
    finally:
        os.unlink(report)
    if not data.get("tests"):
        raise RuntimeError(
            f"{mode} run of transformers' tests collected nothing (exit {proc.returncode}):\n"
            + (proc.stdout + proc.stderr)[-3000:]
        )
    tests = {nodeid.split("::")[-1]: rec for nodeid, rec in data["tests"].items()}
    return Run(mode, tests, data.get("models_enabled", 0), data.get("sparse_layer_calls", 0), proc.returncode, seconds)


@dataclass
class Comparison:
    plain: Run
    ours: Run
    regressions: dict[str, str]  # passes on plain, not on ours (and not an expected refusal)
    refusals: dict[str, str]  # expected refusals that failed with our message
    bad_refusals: dict[str, str]  # expected refusals that failed with another error
    fixed: list[str]  # fail on plain, pass on ours

    @property
    def ok(self) -> bool:
        return not self.regressions and not self.bad_refusals

    def summary(self) -> str:
        lines = [f"{'':8} {'passed':>7} {'failed':>7} {'skipped':>8} {'seconds':>8}"]
        for r in (self.plain, self.ours):
            lines.append(
                f"{r.mode:8} {r.count('passed'):7d} {r.count('failed'):7d} {r.count('skipped'):8d} {r.seconds:8.1f}"
            )
        lines.append(
            f"ours: {self.ours.models_enabled} models ran our path, {self.ours.sparse_layer_calls} sparse layer calls"
        )
        lines.append(f"expected refusals (output_attentions): {sorted(self.refusals)}")
        for name, msg in {**self.regressions, **self.bad_refusals}.items():
            lines.append(f"REGRESSION {name}: {msg}")
        if self.fixed:
            lines.append(f"fail on plain, pass on ours: {self.fixed}")
        return "\n".join(lines)


def compare(plain: Run, ours: Run) -> Comparison:
    regressions, refusals, bad_refusals, fixed = {}, {}, {}, []
    for name, p in plain.tests.items():
        o = ours.tests.get(name, {"outcome": "missing", "message": "not run"})
        if p["outcome"] == "failed" and o["outcome"] == "passed":
            fixed.append(name)
        if p["outcome"] != "passed" or o["outcome"] == "passed":
            continue
        if name in EXPECTED_REFUSALS:
            (refusals if REFUSAL_MESSAGE in o["message"] else bad_refusals)[name] = o["message"]
        else:
            regressions[name] = f"{o['outcome']}: {o['message']}"
    return Comparison(plain, ours, regressions, refusals, bad_refusals, sorted(fixed))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="every test of the file (default: CI_SELECTION)")
    ap.add_argument("--backend", default="reference", help="our backend (default reference)")
    ap.add_argument("--json", help="write both runs' outcomes here")
    args = ap.parse_args(argv)
    tree = assemble()
    print(f"test tree {tree.root} from {', '.join(tree.sources)}; placeholders: {tree.placeholders or 'none'}")
    paths = ensure_test_dependencies()
    select = None if args.full else CI_SELECTION
    plain = run(tree, "plain", select=select, extra_paths=paths)
    ours = run(tree, "ours", backend=args.backend, select=select, extra_paths=paths)
    cmp = compare(plain, ours)
    print(cmp.summary())
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"plain": plain.tests, "ours": ours.tests, "ok": cmp.ok, "placeholders": tree.placeholders}, indent=1
            )
        )
    return 0 if cmp.ok else 1


if __name__ == "__main__":
    sys.exit(main())
