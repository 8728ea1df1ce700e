"""Building and loading the native library (`dsv4_cpu.build`) as a shared machine needs it: a cache
only its user can write, no shared fallback, one build per key however many processes ask at
once, nothing left behind by a failed or killed build, `python -m dsv4_cpu build`."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_cpu import build

ROOT = Path(__file__).resolve().parents[2]


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ, DSV4_PREFILL_CACHE=str(cache), PYTHONPATH=str(ROOT), **extra)
    env.pop("DSV4_CPU_SANITIZE", None)
    return env


def test_cache_is_created_private(tmp_path, monkeypatch):
    d = tmp_path / "a" / "cache"
    monkeypatch.setenv("DSV4_PREFILL_CACHE", str(d))
    assert build.cache_dir() == str(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


@pytest.mark.parametrize("problem", ["group-writable", "world-writable", "symlink", "foreign", "open parent"])
def test_unsafe_cache_is_refused(tmp_path, monkeypatch, problem):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    target, match = d, None
    if problem == "group-writable":
        os.chmod(d, 0o770)
        match = "writable by others"
    elif problem == "world-writable":
        os.chmod(d, 0o777)
        match = "writable by others"
    elif problem == "symlink":
        target = tmp_path / "link"
        target.symlink_to(d)
        match = "is a symlink"
    elif problem == "foreign":  # as another user would see a directory this one planted
        monkeypatch.setattr(os, "getuid", lambda: os.stat(d).st_uid + 4242)
        match = "owned by uid"
    else:
        parent = tmp_path / "open"
        parent.mkdir()
        os.chmod(parent, 0o777)  # world-writable without the sticky bit: anyone could swap the cache
        target = parent / "cache"
        target.mkdir(mode=0o700)
        match = "world-writable without the sticky bit"
    monkeypatch.setenv("DSV4_PREFILL_CACHE", str(target))
    with pytest.raises(RuntimeError, match=match):
        build.cache_dir()
    with pytest.raises(RuntimeError, match="DSV4_PREFILL_CACHE"):  # the message says how to fix it
        build.cache_dir()


def test_planted_library_is_refused(tmp_path, monkeypatch):
    """A file at the exact name a build would load (computable by anyone), but writable by others
    or a symlink, is never loaded."""
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("DSV4_PREFILL_CACHE", str(d))
    lib = d / f"dsv4_cpu_{build.kernels_key()}.so"
    lib.write_bytes(b"\x7fELF planted")
    os.chmod(lib, 0o777)
    with pytest.raises(RuntimeError, match="refusing to load .*writable by you only"):
        build.build_kernels()
    lib.unlink()
    (tmp_path / "evil.so").write_bytes(b"\x7fELF planted")
    lib.symlink_to(tmp_path / "evil.so")
    with pytest.raises(RuntimeError, match="refusing to load .*not a regular file"):
        build.build_kernels()


def test_no_shared_fallback_when_the_cache_cannot_be_made(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DSV4_PREFILL_CACHE", str(blocker / "cache"))
    with pytest.raises(RuntimeError, match="cannot create the kernel cache .* set DSV4_PREFILL_CACHE"):
        build.cache_dir()


def test_failed_and_killed_builds_leave_nothing(tmp_path):
    """A build that fails removes its temporary folder; one a killed build left is removed by the
    next build of that key; the error says why."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    code = (
        "import os, glob\n"
        "from dsv4_cpu import build\n"
        "key = build.kernels_key()\n"
        "os.makedirs(os.path.join(build.cache_dir(), f'dsv4_cpu_{key}.dead.tmp'))  # a killed build's\n"
        "try:\n    build.build_kernels()\nexcept RuntimeError as e:\n    print('ERR', e)\n"
        "print('LEFT', sorted(os.path.basename(p) for p in glob.glob(os.path.join(build.cache_dir(), '*.tmp'))))\n"
    )
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *--version*) echo fake 1.0;; *) echo 'fake: no' >&2; exit 3;; esac\n")
    fake.chmod(0o755)
    res = subprocess.run(
        [sys.executable, "-c", code], env=_env(cache, CXX=str(fake)), capture_output=True, text=True, check=True
    )
    assert "ERR c++ failed (3): fake: no" in res.stdout, res.stdout + res.stderr
    assert "LEFT []" in res.stdout, res.stdout


def test_concurrent_builds_share_one_library(tmp_path):
    """Processes that build at once into an empty cache: one compiles (under the lock), every one
    loads the same good library and runs a kernel on it; the build logs its start and duration."""
    cache = tmp_path / "cache"
    code = (
        "import ctypes, numpy as np\n"
        "from dsv4_cpu import binding\n"
        "lib = binding.library()\n"
        "d = np.zeros(576, np.uint8); d[:448] = 0x38; sc = np.full(8, 127, np.uint8); o = np.zeros(512, np.uint16)\n"
        "lib.dsv4_decode_row_bf16(d.ctypes.data, sc.ctypes.data, o.ctypes.data)\n"
        "assert (o[:448] == 0x3F80).all(), o[:4]  # e4m3 0x38 = 1.0 at scale 2^0\n"
        "print('LIB', lib._name)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e.decode()[-2000:] for _, e in outs]
    libs = {line for o, _ in outs for line in o.decode().splitlines() if line.startswith("LIB")}
    assert len(libs) == 1, libs
    logs = "".join(e.decode() for _, e in outs)
    assert logs.count("dsv4_cpu: building dsv4_cpu (") == 1 and logs.count("dsv4_cpu: built dsv4_cpu in") == 1, logs
    assert not list(cache.glob("*.tmp"))


def test_module_build_command(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "dsv4_cpu", "build", "--framework", "torch", "--framework", "jax"],
        env=_env(Path(build.cache_dir())),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    paths = res.stdout.split()
    names = [os.path.basename(p) for p in paths]
    assert names[0].startswith("dsv4_cpu_") and any(n.startswith("dsv4_cpu_torch_") for n in names), names
    assert any(n.startswith("dsv4_cpu_xla_") for n in names) and all(os.path.isfile(p) for p in paths)
    info = subprocess.run(
        [sys.executable, "-m", "dsv4_cpu", "info"], env=_env(Path(build.cache_dir())), capture_output=True, text=True
    )
    assert info.returncode == 0 and "generic=yes" in info.stdout, info.stdout + info.stderr
