"""Builds dsv4-prefill's CPU kernels (`dsv4_cpu/csrc`) once per machine, into a cache only you can write.

Three shared libraries, each named by a hash of everything that goes into it (sources, flags,
compiler versions, the CPU's feature flags, and the framework's version for the two bindings):

- `dsv4_cpu_<key>.so`: the kernels (kvcache.c, kvcache_v41.c, runtime.cc, attention.cc, gather.cc,
  gather_v41.cc, indexer.cc, indexer_two_level.cc and the token / block kernels of attention_isa.cc,
  attention_bf16.cc and indexer_isa.cc compiled once per instruction
  set: generic, AVX2, AVX-512, AVX512-BF16; an instruction set the compiler cannot target is left out and never chosen).
  ctypes loads it (`dsv4_cpu.binding`).
- `dsv4_cpu_xla_<key>.so`: the XLA FFI handlers (xla_ffi.cc, xla_indexer.cc) against jaxlib's FFI headers, linked
  against the kernels' library: loading it reuses the kernels already loaded, so both bindings
  share one copy (one error state, one set of thread-local scratch). The key holds jaxlib's version.
- `dsv4_cpu_torch_<key>.so`: torch's parallel-for (torch_parallel.cc, `at::parallel_for`)
  against the installed torch's headers. The key holds torch's version.

The cache: `$DSV4_PREFILL_CACHE`, else `$XDG_CACHE_HOME/dsv4_prefill`, else
`~/.cache/dsv4_prefill`, created with mode 0700. It is refused (RuntimeError saying why, never a
quiet fallback elsewhere) when it is a symlink, owned by another user, or group- or
world-writable, or when its parent is writable by others without the sticky bit; a library file
is loaded only when it is a regular file of yours that nobody else can write. Builds take a file
lock per library key, so processes building at once wait for one build and all load its result;
a build works in a temporary folder inside the cache that is removed when it fails (and, when a
build was killed, by the next build of the same key). Each build logs one line when it starts
and one with the seconds it took (logger "dsv4_cpu"; to stderr when logging is not set up).
`python -m dsv4_cpu build` builds everything ahead of time (for images and wheels).

Compilers: `$CC` / `$CXX`, else `cc` / `c++`. `DSV4_CPU_SANITIZE=1` builds every library with
AddressSanitizer and UndefinedBehaviorSanitizer (its own keys; the process must preload the
sanitizer runtimes: `make test-sanitize`).
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import time

logger = logging.getLogger("dsv4_cpu")

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
C_SOURCES = ("kvcache.c", "kvcache_v41.c")
CXX_SOURCES = ("runtime.cc", "attention.cc", "gather.cc", "gather_v41.cc", "indexer.cc", "indexer_two_level.cc")
HEADERS = (
    "dsv4_cpu.h",
    "attention_impl.h",
    "runtime.h",
    "indexer_impl.h",
    "kvcache_v41.h",
    "attention_isa.h",
    "indexer_call.h",
)
ISA_SOURCES = ("attention_isa.cc", "attention_bf16.cc", "indexer_isa.cc")  # compiled once per instruction set
XLA_SOURCES = ("xla_ffi.cc", "xla_indexer.cc", "xla_kvcache_v41.cc")
TORCH_SOURCE = "torch_parallel.cc"

C_FLAGS = ("-O3", "-march=native", "-fPIC", "-std=c11", "-fno-math-errno")
CXX_FLAGS = ("-O3", "-fPIC", "-std=gnu++17", "-fno-math-errno", "-ffp-contract=fast", "-pthread")
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g")
# The token kernels per instruction set: (name, fp32 lanes, compiler flags). x86 only beyond generic.
_AVX512 = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-DDSV4_HAVE_AVX512BW")
ISA_BUILDS = (
    ("generic", 4, ()),
    ("avx2", 8, ("-mavx2", "-mfma", "-mf16c")),
    ("avx512", 16, _AVX512),
    ("avx512bf16", 16, (*_AVX512, "-mavx512bf16", "-DDSV4_HAVE_BF16_KERNEL")),
)


# ----------------------------------------------------------------------------- the cache


def cache_dir() -> str:
    """The build cache (created 0700 on first use), after checking nobody else can write it.
    Raises RuntimeError saying what is wrong and how to fix it."""
    d = os.environ.get("DSV4_PREFILL_CACHE")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "dsv4_prefill")
    d = os.path.abspath(d)
    try:
        os.makedirs(os.path.dirname(d), exist_ok=True)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        check_private_dir(d)
    except OSError as e:
        raise RuntimeError(
            f"cannot create the kernel cache {d!r} ({e.strerror}); set DSV4_PREFILL_CACHE to a directory you own"
        ) from None
    return d


def check_private_dir(d: str) -> None:
    """Raise RuntimeError unless `d` is a real directory of this user that only they can write
    (and its parent cannot be used by others to swap it)."""
    fix = "set DSV4_PREFILL_CACHE to a directory only you can write"
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeError(f"the kernel cache {d!r} is a symlink; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"the kernel cache {d!r} is not a directory; {fix}")
    if st.st_uid != os.getuid():
        raise RuntimeError(f"the kernel cache {d!r} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); {fix}")
    if st.st_mode & 0o022:
        raise RuntimeError(f"the kernel cache {d!r} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); {fix}")
    parent = os.stat(os.path.dirname(d))
    if parent.st_mode & 0o002 and not parent.st_mode & stat.S_ISVTX:
        raise RuntimeError(
            f"the kernel cache's parent {os.path.dirname(d)!r} is world-writable without the sticky bit; {fix}"
        )


def check_private_file(path: str) -> None:
    """Raise RuntimeError unless `path` is a regular file of this user that only they can write."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise RuntimeError(f"refusing to load {path!r}: not a regular file")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(
            f"refusing to load {path!r}: owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o} "
            "(it must be yours and writable by you only)"
        )


# ----------------------------------------------------------------------------- compilers


def compiler(var: str = "CC", default: str = "cc") -> str | None:
    return shutil.which(os.environ.get(var) or default)


def _version(cc: str) -> str:
    res = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    return (res.stdout.splitlines() or [""])[0]


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def sanitized() -> bool:
    """Whether this process builds (and loads) the sanitizer builds (DSV4_CPU_SANITIZE=1)."""
    return os.environ.get("DSV4_CPU_SANITIZE", "") not in ("", "0")


def _compilers() -> tuple[str, str]:
    if sys.byteorder != "little":
        raise RuntimeError("the kernels read bf16 and fp8_ds_mla bytes as little-endian; this host is big-endian")
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler found ({os.environ.get('CC') or 'cc'!r} is not on PATH; set CC)")
    cxx = compiler("CXX", "c++")
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found ({os.environ.get('CXX') or 'c++'!r} is not on PATH; set CXX)")
    return cc, cxx


# The CPU flags (/proc/cpuinfo) an instruction set's kernels need.
ISA_CPU_FLAGS = {
    "generic": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
}


def _isa_builds() -> tuple:
    """The instruction sets compiled here: those this CPU runs (the library is per machine: its
    key holds the CPU's flags), all of them where the flags cannot be read; x86 only beyond
    generic. DSV4_CPU_BUILD_ISAS=generic,avx2,... narrows the list (faster builds)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    line = cpu_flags()
    flags = set(line.split(":", 1)[1].split()) if line.startswith(("flags", "Features")) else None
    only = {x.strip() for x in os.environ.get("DSV4_CPU_BUILD_ISAS", "").split(",") if x.strip()}
    out = []
    for b in ISA_BUILDS:
        if b[0] != "generic" and (not x86 or (flags is not None and not set(ISA_CPU_FLAGS[b[0]]) <= flags)):
            continue
        if only and b[0] not in only and b[0] != "generic":
            continue
        out.append(b)
    return tuple(out)


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({res.returncode}): {res.stderr.strip()[-800:]}")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _key(parts) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def _extra_flags() -> tuple[str, ...]:
    return SANITIZE_FLAGS if sanitized() else ()


# ----------------------------------------------------------------------------- builds


def _build(name: str, key: str, make) -> str:
    """The library `<name>_<key>.so` in the cache: loaded as it is when present, else built by
    make(tmpdir) -> the built file's path, under a file lock per key (concurrent builders wait
    for one build and share its result)."""
    d = cache_dir()
    lib = os.path.join(d, f"{name}_{key}.so")
    if os.path.exists(lib):
        check_private_file(lib)
        return lib
    lock_path = os.path.join(d, f"{name}_{key}.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.path.exists(lib):  # another process built it while this one waited
            check_private_file(lib)
            return lib
        for stale in glob.glob(os.path.join(d, f"{name}_{key}.*.tmp")):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        _log(f"dsv4_cpu: building {name} ({key}) in {d}: first use on this machine, about a minute")
        t0 = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix=f"{name}_{key}.", suffix=".tmp", dir=d)
        try:
            built = make(tmp)
            os.chmod(built, 0o700)
            os.replace(built, lib)  # atomic: a reader sees no file or the whole one
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _log(f"dsv4_cpu: built {name} in {time.perf_counter() - t0:.1f} s")
        return lib
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _log(msg: str) -> None:
    if logger.hasHandlers():
        logger.info(msg)
    else:
        print(msg, file=sys.stderr, flush=True)


def _kernel_parts() -> tuple[list, str, str]:
    cc, cxx = _compilers()
    files = [os.path.join(CSRC, f) for f in C_SOURCES + CXX_SOURCES + HEADERS + ISA_SOURCES]
    parts = [_read(f) for f in files] + [
        C_FLAGS,
        CXX_FLAGS,
        _extra_flags(),
        _isa_builds(),
        cc,
        _version(cc),
        cxx,
        _version(cxx),
        cpu_flags(),
    ]
    return parts, cc, cxx


def kernels_key() -> str:
    return _key(_kernel_parts()[0])


def build_kernels() -> str:
    """The kernels' library (built now if needed); its path. Raises RuntimeError saying why it
    cannot be built here."""
    parts, cc, cxx = _kernel_parts()
    key = _key(parts)
    extra = _extra_flags()
    soname = f"dsv4_cpu_{key}.so"

    def make(tmp: str) -> str:
        objs = []
        for f in C_SOURCES:
            objs.append(os.path.join(tmp, f + ".o"))
            _run([cc, *C_FLAGS, *extra, f"-I{CSRC}", "-c", os.path.join(CSRC, f), "-o", objs[-1]])
        built = []
        for isa, lanes, flags in _isa_builds():
            isa_objs = [os.path.join(tmp, f"{src.split('.')[0]}_{isa}.o") for src in ISA_SOURCES]
            cmd = [cxx, *CXX_FLAGS, *extra, f"-I{CSRC}", f"-DDSV4_ISA={isa}", f"-DDSV4_WIDTH={lanes}", *flags]
            try:
                for src, obj in zip(ISA_SOURCES, isa_objs):
                    _run([*cmd, "-c", os.path.join(CSRC, src), "-o", obj])
            except RuntimeError:
                if isa == "generic":
                    raise
                continue  # this compiler cannot target the set: the library runs without it
            objs.extend(isa_objs)
            built.append(isa)
        defs = [f"-DDSV4_BUILT_{isa.upper()}" for isa in built if isa != "generic"]
        for f in CXX_SOURCES:
            objs.append(os.path.join(tmp, f + ".o"))
            _run([cxx, *CXX_FLAGS, *extra, f"-I{CSRC}", *defs, "-c", os.path.join(CSRC, f), "-o", objs[-1]])
        out = os.path.join(tmp, soname)
        _run([cxx, "-shared", "-pthread", *extra, f"-Wl,-soname,{soname}", *objs, "-o", out])
        return out

    return _build("dsv4_cpu", key, make)


def build_xla(include_dir: str, jaxlib_version: str) -> str:
    """The XLA FFI handlers' library for this jaxlib (its FFI headers in `include_dir`), linked
    against the kernels' library (built first); its path."""
    kernels = build_kernels()
    _, cxx = _compilers()
    extra = _extra_flags()
    srcs = [os.path.join(CSRC, f) for f in XLA_SOURCES]
    key = _key(
        [
            *map(_read, srcs),
            os.path.basename(kernels),
            CXX_FLAGS,
            extra,
            cxx,
            _version(cxx),
            include_dir,
            jaxlib_version,
        ]
    )

    def make(tmp: str) -> str:
        objs = []
        for src in srcs:
            objs.append(os.path.join(tmp, os.path.basename(src) + ".o"))
            _run([cxx, *CXX_FLAGS, *extra, f"-I{CSRC}", f"-I{include_dir}", "-c", src, "-o", objs[-1]])
        out = os.path.join(tmp, "lib.so")
        kd = os.path.dirname(kernels)
        _run(
            [
                cxx,
                "-shared",
                "-pthread",
                *extra,
                *objs,
                f"-L{kd}",
                f"-l:{os.path.basename(kernels)}",
                "-Wl,-rpath,$ORIGIN",
                "-o",
                out,
            ]
        )
        return out

    return _build("dsv4_cpu_xla", key, make)


def build_torch(include_dirs: tuple[str, ...], lib_dir: str, cxx11_abi: bool, torch_version: str) -> str:
    """torch's parallel-for for the kernels (`dsv4_torch_parallel_run`), built against the
    installed torch (headers in include_dirs, libraries in lib_dir); its path."""
    _, cxx = _compilers()
    extra = _extra_flags()
    src = os.path.join(CSRC, TORCH_SOURCE)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}"
    key = _key(
        [
            _read(src),
            _read(os.path.join(CSRC, "dsv4_cpu.h")),
            CXX_FLAGS,
            extra,
            abi,
            "-fopenmp",
            cxx,
            _version(cxx),
            include_dirs,
            lib_dir,
            torch_version,
        ]
    )

    def make(tmp: str) -> str:
        out = os.path.join(tmp, "lib.so")
        incs = [f"-I{CSRC}", *(f"-I{p}" for p in include_dirs)]
        # -fopenmp: at::parallel_for is an inline template whose `#pragma omp parallel` is compiled
        # here; without it the loop runs on the calling thread alone. The OpenMP runtime it binds
        # (NEEDED libgomp.so.1) is torch's own, already loaded by libtorch_cpu (same soname, and
        # torch's lib dir first in the rpath), so it is torch's thread pool, not a second one.
        _run(
            [
                cxx,
                *CXX_FLAGS,
                *extra,
                abi,
                "-fopenmp",
                *incs,
                "-shared",
                src,
                "-o",
                out,
                f"-L{lib_dir}",
                "-ltorch_cpu",
                "-lc10",
                f"-Wl,-rpath,{lib_dir}",
            ]
        )
        return out

    return _build("dsv4_cpu_torch", key, make)
