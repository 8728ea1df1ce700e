"""pyproject.toml: what `pip install .` ships and says (a wheel build is too slow for every run;
`pip wheel . -w DIR --no-deps` and its listing check the same by hand)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_package_data_ships_every_c_and_cpp_source():
    data = PROJECT["tool"]["setuptools"]["package-data"]
    packages = ("planner", "dsv4_cpu", "dsv4_torch", "dsv4_jax")
    sources = [
        p for pkg in packages for p in (ROOT / pkg).glob("**/csrc/*") if p.suffix in (".c", ".cc", ".h", ".cpp", ".hpp")
    ]
    assert len(sources) >= 6, sources
    for path in sources:
        rel = path.relative_to(ROOT)
        owners = [pkg for pkg in data if rel.parts[: len(pkg.split("."))] == tuple(pkg.split("."))]
        assert owners, f"{rel}: in no package of [tool.setuptools.package-data]"
        inside = str(Path(*rel.parts[len(owners[0].split(".")) :]))
        assert any(fnmatch.fnmatch(inside, pattern) for pattern in data[owners[0]]), f"{rel} is not shipped"


def test_license_is_an_spdx_string():
    assert PROJECT["project"]["license"] == "MIT"  # a table is deprecated (setuptools >= 77)
    assert any(r.startswith("setuptools>=77") for r in PROJECT["build-system"]["requires"])
