"""The README is a front door and the docs hold the depth: links, named figures, commands and
paths in them must point at things that exist (a moved file or a renamed benchmark section fails
here, not in a reader's hands)."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
PACKAGES = ("planner", "dsv4_cpu", "dsv4_torch", "dsv4_jax", "bench", "tools", "tests", "eval")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_readme_is_a_front_door():
    text = _text(ROOT / "README.md")
    lines = text.splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines; the depth belongs in docs/<topic>.md"
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"], commands
    assert "## What runs where" in text
    # every topic doc is reachable from the front door
    for doc in DOCS:
        assert f"docs/{doc.name}" in text, f"README.md does not link docs/{doc.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_exist(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _text(page)):
        if "://" in target or not re.search(r"[./]", target):  # a URL, or `f[...](x)` in code
            continue
        assert (page.parent / target).exists(), f"{page.name}: link to {target!r}, which does not exist"


def _headings() -> list[str]:
    return [
        line.lstrip("#").strip() for line in _text(ROOT / "docs" / "benchmarks.md").splitlines() if line.startswith("#")
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_figures_exist(page):
    """`[benchmarks.md](benchmarks.md), "Section", "Other"` names sections by the start of their heading."""
    heads = _headings()
    text = re.sub(r"\s+", " ", _text(page))
    for names in re.findall(r"\[benchmarks\.md\]\([^)]*\),((?: \"[^\"]+\"(?:,| and)?)+)", text):
        for name in re.findall(r"\"([^\"]+)\"", names):
            assert any(h.startswith(name) for h in heads), f"{page.name}: no benchmarks.md section starts with {name!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_m_targets_exist(page):
    for module in re.findall(r"python3? -m ([\w.]+)", _text(page)):
        if module.split(".")[0] not in PACKAGES or module.split(".")[-1].isupper():  # bench.NAME: a placeholder
            continue
        base = ROOT / module.replace(".", "/")
        assert base.with_suffix(".py").exists() or (base / "__main__.py").exists(), (
            f"{page.name}: `python -m {module}` names no module here"
        )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_paths_exist(page):
    pattern = r"`((?:" + "|".join(PACKAGES) + r")/[\w/.*\-]*\w)`"
    for path in re.findall(pattern, _text(page)):
        assert glob.glob(str(ROOT / path)), f"{page.name}: `{path}` does not exist"
