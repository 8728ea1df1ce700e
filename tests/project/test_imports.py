"""The library's import graph: no module imports one that (directly or not) imports it back, at
module level or inside a function (a function-level import that climbs back up is the same loop,
deferred). Read statically from the sources, so it covers code paths no other test runs."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("planner", "dsv4_cpu", "dsv4_torch", "dsv4_jax", "eval")
MAX_LINES = 600  # a library file longer than this is split by concern


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports anywhere in its source (TYPE_CHECKING-only blocks excluded)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` bodies never run
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for a in node.names:  # `from pkg import mod` imports the module pkg.mod
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


# Loops that came in with code this branch may not edit, each with its fix; the test fails when one
# disappears too, so the list only shrinks. (As sets of modules: each is a strongly connected group.)
KNOWN_LOOPS: list[set[str]] = []  # none: add a group only with the reason and its fix


def _loops(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan), i.e. the import loops."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_import_loops():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    loops = sorted(map(sorted, _loops(graph)))
    assert loops == sorted(map(sorted, KNOWN_LOOPS)), "import loops (modules that import each other):\n" + "\n".join(
        " <-> ".join(group) for group in loops
    )


def test_loop_finder():
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _loops({"a": {"b"}, "b": set()}) == []


def test_the_graph_is_read():
    """The reader sees function-level imports (the loops this test is about hide there)."""
    modules = _modules()
    assert "planner.contract" in _imports(
        "dsv4_jax.kernels.mosaic_gpu.attention", modules["dsv4_jax.kernels.mosaic_gpu.attention"], modules
    )
    assert "dsv4_torch.kernels.cpu.kvcache" in _imports("dsv4_torch.kvcache", modules["dsv4_torch.kvcache"], modules)


def test_no_library_file_over_max_lines():
    long = {
        str(p.relative_to(ROOT)): n for p in _modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"library files over {MAX_LINES} lines (split them by concern): {long}"


def test_native_sources_stay_short():
    """The C/C++ sources follow the same rule as the Python ones."""
    sources = [p for p in (ROOT / "dsv4_cpu" / "csrc").iterdir() if p.suffix in (".c", ".cc", ".h")]
    assert len(sources) >= 8, sources
    long = {p.name: n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"C/C++ files over {MAX_LINES} lines (split them by concern): {long}"


def test_planner_is_numpy_only():
    """planner/ imports no framework and holds no native code (that is dsv4_cpu's)."""
    frameworks = {"torch", "jax", "jaxlib", "triton", "ctypes"}
    for path in (ROOT / "planner").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not names & frameworks, (path, names & frameworks)
    assert not [p for p in (ROOT / "planner").rglob("*") if p.suffix in (".c", ".cc", ".h", ".so")]
