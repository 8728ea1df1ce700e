"""A C kernel for the `fp8_ds_mla` gather-dequantize on CPU tensors (layout: `planner/kvcache.py`).

vLLM's reader, `dequantize_and_gather_k_cache`, as one pass over the rows: each row's page comes
from the block table, its 448 e4m3 bytes become bf16 `e4m3 * 2^(byte - 127)` (float32 math, then
round-to-nearest-even, the NumPy reference's exact rule, NaN codes and scale byte 255 included),
its 128 RoPE bytes are copied. No per-row metadata and no intermediate tensors: the rows are read
once and written once, which is what takes this path from ~7% of a plain copy's throughput (the
vectorized torch path, several passes) to the copy's range (`python -m bench.bench_kvcache`).

The source below is compiled once per machine with the system C compiler (`$CC`, else `cc`;
`-O3 -march=native`, no fast-math: IEEE float32 multiplies and the integer rounding give the
reference's bits) into `$DSV4_PREFILL_CACHE` (default `~/.cache/dsv4_prefill`), keyed by the
source, the flags, the compiler and the CPU's feature flags. No compiler, or a failing build:
`unavailable_reason()` says why and `dsv4_torch.kvcache` keeps its torch path (same bits).
Large calls are split into row ranges run on `torch.get_num_threads()` Python threads (ctypes
releases the GIL for the call).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from planner.kvcache import HEAD_DIM, NOPE_DIM, SLOT_DATA_BYTES

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* e4m3 byte -> float32 e4m3(b), exact, branch-free (vectorizes): normal codes by moving the
   exponent and mantissa bits into place and rebiasing (7 -> 127), subnormal codes m * 2^-9. */
static inline float e4m3_to_f32(uint32_t b) {
    uint32_t code = b & 0x7Fu;
    uint32_t nbits = ((b & 0x80u) << 24) | ((code << 20) + (120u << 23));
    float nf; memcpy(&nf, &nbits, 4);
    float sf = (float)(code & 7u) * 0x1p-9f;
    sf = (b & 0x80u) ? -sf : sf;
    return (code >> 3) ? nf : sf;
}

/* float32 -> bf16 bits, round to nearest even; NaN -> 0x7FC0. */
static inline uint16_t f32_to_bf16(float p) {
    uint32_t u; memcpy(&u, &p, 4);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (p != p) ? (uint16_t)0x7FC0u : (uint16_t)r;
}

/* One group of 64 e4m3 bytes -> bf16 bits, the float path: any scale byte. */
static void decode_group_float(const uint8_t *restrict d, uint16_t *restrict o, float s) {
    for (int j = 0; j < 64; j++) {
        uint32_t b = d[j];
        uint16_t v = f32_to_bf16(e4m3_to_f32(b) * s);
        o[j] = ((b & 0x7Fu) == 0x7Fu) ? (uint16_t)0x7FC0u : v;
    }
}

/* The same for scale bytes 10..246 (k = byte - 127 in [-117, 119]), in 16-bit integer lanes:
   every e4m3 value times 2^k is then a normal bf16 (or zero), exact, so its bits are formed
   directly. Normal codes: sign | (code << 4) + (120 + k) << 7. Subnormal codes m = 1..7
   (m * 2^-9): exponent 118 + k + h (h = 0, 1, 2 for m in 1, 2..3, 4..7) and fraction
   (m << (7 - h)) & 0x7F. NaN codes: 0x7FC0. GCC/Clang vector types: 16 lanes per op (AVX2,
   two NEON registers), nothing machine-specific in the source. */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));

/* Whether a group of 64 e4m3 bytes holds a subnormal (1..7) or NaN (0x7F) code. */
static inline int group_has_special(const uint8_t *restrict d) {
    u8x16 acc = {0};
    for (int j = 0; j < 64; j += 16) {
        u8x16 xb;
        memcpy(&xb, d + j, 16);
        u8x16 c = xb & 0x7F;
        acc |= (u8x16)((u8x16)(c - 1) < 7) | (u8x16)(c == 0x7F);
    }
    uint64_t w[2];
    memcpy(w, &acc, 16);
    return (w[0] | w[1]) != 0;
}

/* Groups with normal and zero codes only: sign | (code ? (code << 4) + (120 + k) << 7 : 0). */
static void decode_group_normal(const uint8_t *restrict d, uint16_t *restrict o, int k) {
    const u16x16 cn = (u16x16){0} + (uint16_t)((120 + k) << 7);
    for (int j = 0; j < 64; j += 16) {
        u8x16 xb;
        memcpy(&xb, d + j, 16);
        u16x16 x = __builtin_convertvector(xb, u16x16);
        u16x16 code = x & 0x7F;
        u16x16 nz = (u16x16)((i16x16)code != 0);
        u16x16 r = (nz & ((code << 4) + cn)) | ((x << 8) & 0x8000);
        memcpy(o + j, &r, 32);
    }
}

static void decode_group_int(const uint8_t *restrict d, uint16_t *restrict o, int k) {
    const u16x16 cn = (u16x16){0} + (uint16_t)((120 + k) << 7);
    const u16x16 cs = (u16x16){0} + (uint16_t)((118 + k) << 7);
    for (int j = 0; j < 64; j += 16) {
        u8x16 xb;
        memcpy(&xb, d + j, 16);
        u16x16 x = __builtin_convertvector(xb, u16x16);
        u16x16 code = x & 0x7F;
        u16x16 sign = (x << 8) & 0x8000;
        u16x16 norm = (code << 4) + cn;
        i16x16 c = (i16x16)code;
        u16x16 ge2 = (u16x16)(c > 1), ge4 = (u16x16)(c > 3), issub = (u16x16)(c < 8);
        u16x16 nz = (u16x16)(c != 0), nan = (u16x16)(c == 0x7F);
        u16x16 mul = 128 - (ge2 & 64) - (ge4 & 32);
        u16x16 sub = (cs + ((ge2 & 128) + (ge4 & 128))) | ((code * mul) & 0x7F);
        u16x16 v = (issub & nz & sub) | (~issub & norm);
        u16x16 r = (nan & 0x7FC0) | (~nan & (v | sign));
        memcpy(o + j, &r, 32);
    }
}

static void decode_row_bf16(const uint8_t *restrict d, const uint8_t *restrict sc,
                            uint16_t *restrict o, const float *restrict scale_of) {
    for (int g = 0; g < 7; g++) {
        int byte = sc[g];
        if (byte < 10 || byte > 246) decode_group_float(d + 64 * g, o + 64 * g, scale_of[byte]);
        else if (group_has_special(d + 64 * g)) decode_group_int(d + 64 * g, o + 64 * g, byte - 127);
        else decode_group_normal(d + 64 * g, o + 64 * g, byte - 127);
    }
    memcpy(o + 448, d + 448, 128); /* RoPE dims: little-endian bf16 bytes */
}

static void decode_row_f32(const uint8_t *restrict d, const uint8_t *restrict sc,
                           uint32_t *restrict o, const float *restrict scale_of) {
    uint16_t t[512]; /* the bf16 row, then widened: float32 holding the bf16 values */
    decode_row_bf16(d, sc, t, scale_of);
    for (int j = 0; j < 512; j++) o[j] = (uint32_t)t[j] << 16;
}

#define AHEAD 8

static inline int64_t page_of(const void *bt, int bt_int64, int64_t i) {
    return bt_int64 ? ((const int64_t *)bt)[i] : (int64_t)((const int32_t *)bt)[i];
}

/* Rows [row0, row1) of the requests' rows laid back to back (cum: [R + 1] prefix sums of the
   gather lengths). Row i of request b: position seq[b] - g[b] + i, page bt[b, pos / S], slot
   pos % S, written to out + b * out_s0 + (offset + i) * out_s1 (element strides). */
void dsv4_gather_dequant(void *out, int64_t out_s0, int64_t out_s1, int out_f32,
                         const uint8_t *cache, int64_t page_stride, int64_t S,
                         const int64_t *seq, const int64_t *cum,
                         const void *bt, int bt_int64, int64_t bt_s0,
                         int64_t offset, int64_t R, int64_t row0, int64_t row1) {
    float scale_of[256];
    for (int i = 0; i < 256; i++) {
        uint32_t bits;
        if (i == 255) bits = 0x7F800000u;                 /* 2^128: inf in float32 */
        else if (i == 0) bits = 0x00400000u;              /* 2^-127: a subnormal */
        else bits = (uint32_t)i << 23;                    /* 2^(i - 127) */
        memcpy(&scale_of[i], &bits, 4);
    }
    int64_t lo = 0, hi = R; /* the request holding row0: cum[b] <= row0 < cum[b + 1] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (cum[mid] <= row0) lo = mid; else hi = mid;
    }
    int64_t b = lo;
    for (int64_t r = row0; r < row1; b++) {
        int64_t g = cum[b + 1] - cum[b];
        if (g == 0) continue;
        int64_t i0 = r - cum[b];
        int64_t i1 = (row1 < cum[b + 1] ? row1 : cum[b + 1]) - cum[b];
        int64_t pos = seq[b] - g + i0;
        int64_t blk = pos / S, p = pos - blk * S; /* then stepped: no division per row */
        /* a second cursor AHEAD rows on prefetches the rows' bytes: pages in block-table order
           are scattered, so on small pages (S = 2: HCA caches) nothing else hides the misses */
        int64_t ia = i0 + AHEAD < i1 ? i0 + AHEAD : i1;
        int64_t pa_pos = seq[b] - g + ia, blka = pa_pos / S, pa = pa_pos - blka * S;
        const uint8_t *base = 0;
        for (int64_t i = i0; i < i1; i++) {
            if (i == i0 || p == 0) base = cache + page_of(bt, bt_int64, b * bt_s0 + blk) * page_stride;
            if (ia < i1) {
                const uint8_t *ba = cache + page_of(bt, bt_int64, b * bt_s0 + blka) * page_stride;
                for (int l = 0; l < 576; l += 64) __builtin_prefetch(ba + pa * 576 + l, 0, 3);
                __builtin_prefetch(ba + S * 576 + pa * 8, 0, 3);
                ia++;
                if (++pa == S) { pa = 0; blka++; }
            }
            const uint8_t *d = base + p * 576;
            const uint8_t *sc = base + S * 576 + p * 8;
            int64_t o = b * out_s0 + (offset + i) * out_s1;
            if (out_f32) decode_row_f32(d, sc, (uint32_t *)out + o, scale_of);
            else decode_row_bf16(d, sc, (uint16_t *)out + o, scale_of);
            if (++p == S) { p = 0; blk++; }
        }
        r = cum[b] + i1;
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-fno-math-errno"]
_PARALLEL_ROWS = (
    4096  # calls gathering at least this many rows per thread are split across threads
)
_lock = threading.Lock()
_state: dict = {}


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def _cache_dir() -> str:
    d = os.environ.get("DSV4_PREFILL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "dsv4_prefill"
    )
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


def _build():
    if sys.byteorder != "little":
        raise RuntimeError(
            "the C kernel reads RoPE dims as little-endian bf16; this host is big-endian"
        )
    cc = _compiler()
    if cc is None:
        raise RuntimeError(
            f"no C compiler found ({os.environ.get('CC') or 'cc'!r} is not on PATH; set CC)"
        )
    ver = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[:1]
    key = hashlib.sha256(
        "\0".join([_SOURCE, " ".join(_FLAGS), cc, *ver, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    d = _cache_dir()
    lib = os.path.join(d, f"cpu_kvcache_{key}.so")
    if not os.path.exists(lib):
        src = os.path.join(d, f"cpu_kvcache_{key}.{os.getpid()}.c")
        tmp = src[:-2] + ".so"
        with open(src, "w") as f:
            f.write(_SOURCE)
        try:
            res = subprocess.run(
                [cc, *_FLAGS, src, "-o", tmp],
                capture_output=True,
                text=True,
                check=False,
            )
            if res.returncode != 0:
                raise RuntimeError(
                    f"{cc} failed ({res.returncode}): {res.stderr.strip()[-500:]}"
                )
            os.replace(tmp, lib)  # atomic: concurrent builders agree on the file
        finally:
            for p in (src, tmp):
                if os.path.exists(p):
                    os.unlink(p)
    dll = ctypes.CDLL(lib)
    fn = dll.dsv4_gather_dequant
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        ptr,
        i64,
        i64,
        ctypes.c_int,
        ptr,
        i64,
        i64,
        ptr,
        ptr,
        ptr,
        ctypes.c_int,
        i64,
        i64,
        i64,
        i64,
        i64,
    ]
    fn.restype = None
    return fn


def _kernel():
    with _lock:
        if "fn" not in _state and "error" not in _state:
            try:
                _state["fn"] = _build()
            except Exception as e:  # noqa: BLE001 - any build failure is the reason
                _state["error"] = f"{type(e).__name__}: {e}"
        return _state.get("fn")


def unavailable_reason() -> str | None:
    """None when the kernel is built (or builds now); else why it cannot run here."""
    _kernel()
    return _state.get("error")


_pool: list = []


def _executor(n: int) -> ThreadPoolExecutor:
    if not _pool or _pool[0]._max_workers < n:
        _pool[:] = [
            ThreadPoolExecutor(max_workers=n, thread_name_prefix="dsv4-kvcache")
        ]
    return _pool[0]


def gather_dequant(out: torch.Tensor, k_cache: torch.Tensor, seq: torch.Tensor, glen: torch.Tensor | None,
                   bt: torch.Tensor, S: int, offset: int, *, threads: int | None = None) -> None:  # fmt: skip
    """`dequantize_and_gather_k_cache` on CPU tensors, arguments already checked by the caller:
    out bf16 or float32 [R', rows, 512] (last dim unit stride), k_cache uint8 pages (stride(0) is
    the page stride), seq / glen int [R] (glen None: all seq positions), bt int32/int64 [R'', B]
    with unit stride in dim 1."""
    fn = _kernel()
    if fn is None:
        from dsv4_torch.attention import BackendUnavailableError

        raise BackendUnavailableError(
            f"backend='cpu' cannot run here: {_state['error']}"
        )
    R = seq.shape[0]
    # the per-request arrays on the host (CPU tensors: no copy), as NumPy: O(requests)
    seq64 = np.ascontiguousarray(seq.detach().numpy(), dtype=np.int64)
    g = seq64 if glen is None else glen.detach().numpy().astype(np.int64)
    cum = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(g, out=cum[1:])
    n = int(cum[-1])
    if n == 0:
        return
    if out.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out: expected bfloat16 or float32, got {out.dtype}")
    if bt.dtype not in (torch.int32, torch.int64) or bt.stride(1) != 1:
        raise ValueError(
            f"block_table: expected int32/int64 with unit stride in dim 1, got {bt.dtype} {bt.stride()}"
        )
    args = (out.data_ptr(), out.stride(0), out.stride(1), int(out.dtype == torch.float32),
            k_cache.data_ptr(), k_cache.stride(0), S, seq64.ctypes.data, cum.ctypes.data,
            bt.data_ptr(), int(bt.dtype == torch.int64), bt.stride(0), offset, R)  # fmt: skip
    t = max(1, min(threads or torch.get_num_threads(), n // _PARALLEL_ROWS))
    if t == 1:
        fn(*args, 0, n)
        return
    bounds = [n * k // t for k in range(t + 1)]
    list(_executor(t).map(lambda k: fn(*args, bounds[k], bounds[k + 1]), range(t)))


assert (
    NOPE_DIM == 448 and HEAD_DIM == 512 and SLOT_DATA_BYTES == 576
)  # the C source's constants
