"""dsv4-prefill's CPU kernels (framework-free C/C++ in `planner/csrc/`), built once per machine.

Two kernels, one shared library, plain pointers (`planner/csrc/dsv4_cpu.h`), called by both
frameworks: `dsv4_torch` through ctypes, `dsv4_jax` as XLA FFI custom calls
(`dsv4_jax/kernels/csrc/cpu_ffi.cc`, built into its own copy of the library).

- `kvcache.c`: vLLM's `dequantize_and_gather_k_cache` for `fp8_ds_mla` pages (layout:
  `planner/kvcache.py`) as one pass over the rows, the NumPy reference's bits. Each 64-dim group
  is decoded with integer math only (a thread that flushes float subnormals, as XLA's CPU threads
  do, gets the same bits): scale bytes 10..246 in 16-lane vector code (GCC/Clang vector types),
  other scale bytes (never written by vLLM's writer) by an exact scalar rounding. Every read and
  write is bounds-checked: a row whose position or block-table entry is not a page of the cache
  comes out NaN, rows past `out_rows` are not written. `python -m bench.bench_kvcache`.
- `attention.cc` + `attention_isa.cc`: the sparse-attention backend "cpu" (FlashMLA's contract),
  on a flat workspace (`dsv4_sparse_attention`) or straight from the caches in a prefill
  (`dsv4_prefill_attention`: bf16 / float32 rows or fp8_ds_mla pages, no workspace). The token
  kernels are compiled once per instruction set (generic vector code, AVX2, AVX-512,
  AVX512-BF16), each with its own flags, and chosen at run time from the CPU's features;
  `DSV4_PREFILL_CPU_ISA=generic|avx2|avx512|avx512bf16` caps the choice (tests use it to run
  every set the machine has).

Build: with the system compilers (`$CC` / `$CXX`, else `cc` / `c++`) into `$DSV4_PREFILL_CACHE`
(default `~/.cache/dsv4_prefill`), keyed by the sources, flags, compiler versions and the CPU's
feature flags. No compiler or a failed build: `unavailable_reason()` says why, and "auto"
keeps the array-op paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

from planner.kvcache import HEAD_DIM, NOPE_DIM, SLOT_DATA_BYTES, SLOT_SCALE_BYTES

FLAGS = ("-O3", "-march=native", "-fPIC", "-std=c11", "-fno-math-errno")
# a call is split across threads only with at least this many rows per thread
PARALLEL_ROWS = 4096
# calls writing more than this many bytes use non-temporal stores (their output leaves the caches)
STREAM_BYTES = 8 << 20

_lock = threading.RLock()
_state: dict = {}


def compiler(var: str = "CC", default: str = "cc") -> str | None:
    return shutil.which(os.environ.get(var) or default)


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def cache_dir() -> str:
    d = os.environ.get("DSV4_PREFILL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsv4_prefill")
    try:
        os.makedirs(d, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = os.path.join(
        tempfile.gettempdir(),
        f"dsv4_prefill_{os.getuid() if hasattr(os, 'getuid') else 'user'}",
    )
    os.makedirs(d, exist_ok=True)
    return d


def _version(cc: str) -> str:
    res = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    return (res.stdout.splitlines() or [""])[0]


CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
C_SOURCES = ("kvcache.c",)
CXX_SOURCES = ("attention.cc",)
HEADERS = ("dsv4_cpu.h", "attention_impl.h")
ISA_SOURCE = "attention_isa.cc"
CXX_FLAGS = ("-O3", "-fPIC", "-std=gnu++17", "-fno-math-errno", "-ffp-contract=fast", "-pthread")
# The token kernels per instruction set: (name, fp32 lanes, compiler flags). x86 only beyond generic.
ISA_BUILDS = (
    ("generic", 4, ()),
    ("avx2", 8, ("-mavx2", "-mfma", "-mf16c")),
    (
        "avx512",
        16,
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-DDSV4_HAVE_AVX512BW"),
    ),
    (
        "avx512bf16",
        16,
        (
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512bf16",
            "-DDSV4_HAVE_AVX512BW",
            "-DDSV4_HAVE_BF16_KERNEL",
        ),
    ),
)
# Instruction sets by number, as dsv4_cpu.h numbers them.
ISAS = ("generic", "avx2", "avx512", "avx512bf16", "amx")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _isa_builds() -> tuple:
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    return tuple(b for b in ISA_BUILDS if b[0] == "generic" or x86)


def build_library(name: str, extra_sources: tuple[str, ...] = (), include_dirs: tuple[str, ...] = ()) -> str:
    """Compile the kernels (and `extra_sources`, C++ files calling them, e.g. JAX's FFI handlers)
    into a shared library in the cache directory; returns its path. An instruction set whose
    token kernel the compiler cannot build is left out (the library then never chooses it).
    Raises RuntimeError saying why when the library cannot be built."""
    if sys.byteorder != "little":
        raise RuntimeError("the kernels read bf16 and fp8_ds_mla bytes as little-endian; this host is big-endian")
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler found ({os.environ.get('CC') or 'cc'!r} is not on PATH; set CC)")
    cxx = compiler("CXX", "c++")
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found ({os.environ.get('CXX') or 'c++'!r} is not on PATH; set CXX)")
    files = [os.path.join(CSRC, f) for f in C_SOURCES + CXX_SOURCES + HEADERS + (ISA_SOURCE,)] + list(extra_sources)
    parts = [_read(f) for f in files] + [
        " ".join(FLAGS),
        " ".join(CXX_FLAGS),
        repr(_isa_builds()),
        cc,
        _version(cc),
        cxx,
        _version(cxx),
        cpu_flags(),
        *include_dirs,
    ]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    d = cache_dir()
    lib = os.path.join(d, f"{name}_{key}.so")
    if os.path.exists(lib):
        return lib
    tmp = tempfile.mkdtemp(prefix=f"{name}_{key}.", dir=d)
    try:
        objs = []
        incs = [f"-I{CSRC}", *(f"-I{p}" for p in include_dirs)]
        for f in C_SOURCES:
            objs.append(os.path.join(tmp, f + ".o"))
            _run([cc, *FLAGS, f"-I{CSRC}", "-c", os.path.join(CSRC, f), "-o", objs[-1]])
        built = []
        for isa, lanes, flags in _isa_builds():
            obj = os.path.join(tmp, f"attention_{isa}.o")
            try:
                _run(
                    [
                        cxx,
                        *CXX_FLAGS,
                        *incs,
                        f"-DDSV4_ISA={isa}",
                        f"-DDSV4_WIDTH={lanes}",
                        *flags,
                        "-c",
                        os.path.join(CSRC, ISA_SOURCE),
                        "-o",
                        obj,
                    ]
                )
            except RuntimeError:
                if isa == "generic":
                    raise
                continue  # this compiler cannot target the set: the library runs without it
            objs.append(obj)
            built.append(isa)
        defs = [f"-DDSV4_BUILT_{isa.upper()}" for isa in built if isa != "generic"]
        for f in CXX_SOURCES:
            objs.append(os.path.join(tmp, f + ".o"))
            _run([cxx, *CXX_FLAGS, *incs, *defs, "-c", os.path.join(CSRC, f), "-o", objs[-1]])
        for f in extra_sources:
            objs.append(os.path.join(tmp, os.path.basename(f) + ".o"))
            _run([cxx, *CXX_FLAGS, *incs, "-c", f, "-o", objs[-1]])
        out = os.path.join(tmp, "lib.so")
        _run([cxx, "-shared", "-pthread", *objs, "-o", out])
        os.replace(out, lib)  # atomic: concurrent builders agree on the file
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lib


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({res.returncode}): {res.stderr.strip()[-800:]}")


class KVSource(ctypes.Structure):
    """`dsv4_kv_source` (dsv4_cpu.h): where a prefill's key rows come from."""

    _fields_ = [
        ("format", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("row_stride", ctypes.c_int64),
        ("num_rows", ctypes.c_int64),
        ("page_stride", ctypes.c_int64),
        ("num_pages", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("table", ctypes.c_void_p),
        ("table_int64", ctypes.c_int32),
        ("table_stride", ctypes.c_int64),
        ("table_width", ctypes.c_int64),
        ("table_rows", ctypes.c_int64),
    ]


class Outputs(ctypes.Structure):
    """`dsv4_outputs`: out [T, H, d_v] (element strides), max_logits / lse [T, H] float32 or NULL."""

    _fields_ = [
        ("out", ctypes.c_void_p),
        ("out_s0", ctypes.c_int64),
        ("out_s1", ctypes.c_int64),
        ("max_logits", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("stat_s0", ctypes.c_int64),
    ]


class PrefillTokens(ctypes.Structure):
    """`dsv4_prefill_tokens`: one layer's prefill tokens and the rule of their key sets."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("compress_ratio", ctypes.c_int32),
        ("num_tokens", ctypes.c_int64),
        ("token_row", ctypes.c_void_p),
        ("token_request", ctypes.c_void_p),
        ("token_position", ctypes.c_void_p),
        ("topk", ctypes.c_void_p),
        ("topk_int64", ctypes.c_int32),
        ("topk_stride", ctypes.c_int64),
        ("topk_width", ctypes.c_int64),
    ]


BF16, F32 = 0, 1  # dsv4_cpu.h's dtype codes
KIND_CODES = {"SWA": 0, "CSA": 1, "HCA": 2}


def library():
    """The kernels' shared library (ctypes), built on first use. Raises RuntimeError when it
    cannot be built here; `unavailable_reason()` is the non-raising check."""
    with _lock:
        if "lib" not in _state:
            if "lib_error" in _state:
                raise RuntimeError(_state["lib_error"])
            try:
                lib = ctypes.CDLL(build_library("dsv4_cpu"))
            except Exception as e:  # noqa: BLE001 - any build failure is the reason
                _state["lib_error"] = f"{type(e).__name__}: {e}"
                raise RuntimeError(_state["lib_error"]) from None
            i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float
            lib.dsv4_sparse_attention.argtypes = [
                ptr,
                i64,
                i64,
                i32,
                i64,
                i64,
                i64,
                ptr,
                i64,
                i64,
                ptr,
                i64,
                i64,
                ptr,
                f32,
                ptr,
                ctypes.POINTER(Outputs),
                i32,
                i32,
            ]
            lib.dsv4_sparse_attention.restype = ctypes.c_int
            lib.dsv4_prefill_attention.argtypes = [
                ptr,
                i64,
                i64,
                i32,
                i64,
                i64,
                ctypes.POINTER(PrefillTokens),
                ctypes.POINTER(KVSource),
                ctypes.POINTER(KVSource),
                f32,
                ptr,
                ctypes.POINTER(Outputs),
                i32,
                i32,
            ]
            lib.dsv4_prefill_attention.restype = ctypes.c_int
            lib.dsv4_cpu_last_error.restype = ctypes.c_char_p
            lib.dsv4_cpu_isa_name.restype = ctypes.c_char_p
            lib.dsv4_cpu_isa_name.argtypes = [i32]
            lib.dsv4_cpu_isa_supported.argtypes = [i32]
            lib.dsv4_cpu_best_isa.argtypes = [i32]
            _state["lib"] = lib
        return _state["lib"]


def attention_unavailable_reason() -> str | None:
    """None when the attention kernels are built (or build now); else why they cannot run here."""
    try:
        library()
    except RuntimeError as e:
        return str(e)
    return None


def isa_supported() -> dict[str, bool]:
    """Each instruction set -> whether this machine runs its kernels (built and supported)."""
    lib = library()
    return {name: bool(lib.dsv4_cpu_isa_supported(i)) for i, name in enumerate(ISAS)}


def best_isa(dtype: int = BF16) -> str:
    """The instruction set a call of this dtype runs (the highest the machine has, capped by
    DSV4_PREFILL_CPU_ISA). Raises ValueError for an unknown DSV4_PREFILL_CPU_ISA name."""
    cap = os.environ.get("DSV4_PREFILL_CPU_ISA")
    if cap and cap not in ISAS:
        raise ValueError(f"DSV4_PREFILL_CPU_ISA: expected one of {', '.join(ISAS)}, got {cap!r}")
    return ISAS[library().dsv4_cpu_best_isa(dtype)]


def isa_code(isa: str | None) -> int:
    """dsv4_cpu.h's number of an instruction set name (None: -1, the best allowed)."""
    if isa is None:
        return -1
    if isa not in ISAS:
        raise ValueError(f"isa: expected one of {', '.join(ISAS)} or None, got {isa!r}")
    return ISAS.index(isa)


def check(rc: int) -> None:
    """Raise for a non-zero return code of a kernel call, with the kernel's message."""
    if rc == 0:
        return
    msg = library().dsv4_cpu_last_error().decode(errors="replace")
    if rc == 2:
        raise RuntimeError(f"instruction set unavailable: {msg}")
    if rc == 3:
        raise MemoryError(msg)
    raise ValueError(msg)


def gather_function():
    """The ctypes function `dsv4_gather_dequant` (signature in C_SOURCE), built on first use;
    None when it cannot be built (`unavailable_reason()` says why)."""
    with _lock:
        if "fn" not in _state and "error" not in _state:
            try:
                fn = library().dsv4_gather_dequant
                i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
                # out, out_s0, out_s1, out_rows, out_f32, stream, cache, page_stride, num_blocks, S,
                # seq, cum, bt, bt_int64, bt_s0, bt_w, offset, R, row0, row1
                fn.argtypes = [
                    ptr,
                    i64,
                    i64,
                    i64,
                    i32,
                    i32,
                    ptr,
                    i64,
                    i64,
                    i64,
                    ptr,
                    ptr,
                    ptr,
                    i32,
                    i64,
                    i64,
                    i64,
                    i64,
                    i64,
                    i64,
                ]
                fn.restype = None
                _state["fn"] = fn
            except Exception as e:  # noqa: BLE001 - any build failure is the reason
                _state["error"] = f"{type(e).__name__}: {e}"
        return _state.get("fn")


def unavailable_reason() -> str | None:
    """None when the C kernel is built (or builds now); else why it cannot run here."""
    gather_function()
    return _state.get("error")


def row_ranges(n: int, threads: int) -> list[tuple[int, int]]:
    """Split n rows into contiguous ranges for `threads` threads (fewer for small calls)."""
    t = max(1, min(threads, n // PARALLEL_ROWS))
    return [(n * k // t, n * (k + 1) // t) for k in range(t)]


assert NOPE_DIM == 448 and HEAD_DIM == 512 and SLOT_DATA_BYTES == 576 and SLOT_SCALE_BYTES == 8  # the C constants
