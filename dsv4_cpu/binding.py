"""The ctypes binding of the kernels' C API (`dsv4_cpu/csrc/dsv4_cpu.h`): the one place Python calls them.

Framework-free: it takes addresses, strides and sizes, and every torch caller (the prefill,
`dsv4_torch.sparse_attention`, the fp8_ds_mla gather, vLLM's CPU engine path) goes through it by
way of `dsv4_torch.kernels.cpu`. JAX calls the same kernels through the XLA FFI handlers
(`dsv4_jax.kernels.cpu`), built into a library linked against this one. The codes shared with
the C side (dtypes, kinds, source layouts, instruction sets) are defined here once, and the
library's own names and ABI version are checked against them when it loads.

Every call releases the GIL (ctypes does) and raises, for a non-zero return code, ValueError
(a bad argument: the C side's message names it), MemoryError, or RuntimeError (an instruction
set that cannot run here).
"""

from __future__ import annotations

import ctypes
import os
import threading

from dsv4_cpu import build

ABI = 4  # dsv4_cpu.h's DSV4_CPU_ABI
BF16, F32 = 0, 1  # dtype codes
KIND_CODES = {"SWA": 0, "CSA": 1, "HCA": 2}  # dsv4_prefill_tokens.kind
ROWS, FP8_DS_MLA = 0, 1  # dsv4_kv_source.format
INDEX_FP8 = 2  # dsv4_cpu.h: DSV4_KV_INDEX_FP8 (dsv4_kv_source.format) and DSV4_FP8_E4M3 (q dtype)
MXFP8_SPLIT, MXFP8_INTERLEAVED = 3, 4  # dsv4_kv_source.format: DeepSeek-V4.1 528-byte records (kvcache_v41.c)
ISAS = ("generic", "avx2", "avx512", "avx512bf16", "amx")  # instruction sets by number
FP8_SLOT_BYTES = 584  # fp8_ds_mla: 576 data bytes + 8 scale bytes per slot

_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float
INDEX_FN = ctypes.CFUNCTYPE(None, _ptr, _i64)
RUN_FN = ctypes.CFUNCTYPE(None, _ptr, _i64, INDEX_FN, _ptr)


class Parallel(ctypes.Structure):
    """`dsv4_parallel`: how a call runs its parallel work (threads, and a fork-join `run` or a
    task `schedule` function of the host framework; neither: the library's own pool)."""

    _fields_ = [("threads", _i32), ("run", _ptr), ("schedule", _ptr), ("ctx", _ptr)]


class KVSource(ctypes.Structure):
    """`dsv4_kv_source`: where a prefill's key rows come from (see dsv4_cpu.h)."""

    _fields_ = [
        ("format", _i32),
        ("dtype", _i32),
        ("data", _ptr),
        ("row_stride", _i64),
        ("num_rows", _i64),
        ("page_stride", _i64),
        ("num_pages", _i64),
        ("page_size", _i64),
        ("table", _ptr),
        ("table_int64", _i32),
        ("table_stride", _i64),
        ("table_width", _i64),
        ("table_rows", _i64),
    ]


class Outputs(ctypes.Structure):
    """`dsv4_outputs`: out [T, H, d_v] (element strides), max_logits / lse [T, H] float32 or NULL."""

    _fields_ = [
        ("out", _ptr),
        ("out_s0", _i64),
        ("out_s1", _i64),
        ("max_logits", _ptr),
        ("lse", _ptr),
        ("stat_s0", _i64),
    ]


class PrefillTokens(ctypes.Structure):
    """`dsv4_prefill_tokens`: one layer's prefill tokens and the rule of their key sets."""

    _fields_ = [
        ("kind", _i32),
        ("window", _i32),
        ("compress_ratio", _i32),
        ("num_tokens", _i64),
        ("token_row", _ptr),
        ("token_request", _ptr),
        ("token_position", _ptr),
        ("topk", _ptr),
        ("topk_int64", _i32),
        ("topk_stride", _i64),
        ("topk_width", _i64),
        ("topk_rows", _i64),
        ("token_window_start", _ptr),  # NULL, or each token's lowest window position
    ]


class IndexCandidates(ctypes.Structure):
    """`dsv4_index_candidates`: the two-level top-k of a `dsv4_indexer_topk_candidates` call (mode
    CANDIDATES_SELECT writes `blocks`, CANDIDATES_RESTRICT reads them; see dsv4_cpu.h)."""

    _fields_ = [
        ("mode", _i32),
        ("block_size", _i64),
        ("topk_blocks", _i64),
        ("blocks", _ptr),
        ("blocks_s0", _i64),
    ]


CANDIDATES_SELECT, CANDIDATES_RESTRICT = 1, 2  # dsv4_index_candidates.mode

_P = ctypes.POINTER
SIGNATURES = {  # name -> (restype, argtypes), as dsv4_cpu.h declares them
    "dsv4_sparse_attention": (
        ctypes.c_int,
        [
            _ptr,
            _i64,
            _i64,
            _i32,
            _i64,
            _i64,
            _i64,
            _ptr,
            _i64,
            _i64,
            _ptr,
            _i64,
            _i64,
            _ptr,
            _f32,
            _ptr,
            _P(Outputs),
            _P(Parallel),
            _i32,
        ],
    ),
    "dsv4_prefill_attention": (
        ctypes.c_int,
        [
            _ptr,
            _i64,
            _i64,
            _i32,
            _i64,
            _i64,
            _i64,
            _P(PrefillTokens),
            _P(KVSource),
            _P(KVSource),
            _f32,
            _ptr,
            _P(Outputs),
            _P(Parallel),
            _i32,
        ],
    ),
    "dsv4_gather_dequant": (
        ctypes.c_int,
        [
            _ptr,
            _i64,
            _i64,
            _i64,
            _i32,
            _ptr,
            _i64,
            _i64,
            _i64,
            _ptr,
            _ptr,
            _ptr,
            _i32,
            _i64,
            _i64,
            _i64,
            _i64,
            _P(Parallel),
        ],
    ),
    "dsv4_gather_mxfp8": (  # DeepSeek-V4.1's 528-byte records: dsv4_gather_dequant's arguments + interleaved
        ctypes.c_int,
        [
            _ptr,
            _i64,
            _i64,
            _i64,
            _i32,
            _ptr,
            _i64,
            _i64,
            _i64,
            _i32,
            _ptr,
            _ptr,
            _ptr,
            _i32,
            _i64,
            _i64,
            _i64,
            _i64,
            _P(Parallel),
        ],
    ),
    "dsv4_decode_mxfp8_bf16": (None, [_ptr, _ptr, _ptr]),
    "dsv4_gather_dequant_rows": (
        None,
        [
            _ptr,
            _i64,
            _i64,
            _i64,
            ctypes.c_int,
            ctypes.c_int,
            _ptr,
            _i64,
            _i64,
            _i64,
            _ptr,
            _ptr,
            _ptr,
            ctypes.c_int,
            _i64,
            _i64,
            _i64,
            _i64,
            _i64,
            _i64,
        ],
    ),
    # dsv4_cpu.h: q, q_s0, q_s1, q_dtype, rows, H, D, weights, w_s0, tokens, keys, topk, out_idx,
    # idx_s0, out_logits, logit_s0, par, isa
    "dsv4_indexer_topk": (
        ctypes.c_int,
        [
            _ptr,
            _i64,
            _i64,
            _i32,
            _i64,
            _i64,
            _i64,
            _ptr,
            _i64,
            _P(PrefillTokens),
            _P(KVSource),
            _i64,
            _ptr,
            _i64,
            _ptr,
            _i64,
            _P(Parallel),
            _i32,
        ],
    ),
    # dsv4_indexer_topk's arguments, then cand
    "dsv4_indexer_topk_candidates": (
        ctypes.c_int,
        [
            _ptr,
            _i64,
            _i64,
            _i32,
            _i64,
            _i64,
            _i64,
            _ptr,
            _i64,
            _P(PrefillTokens),
            _P(KVSource),
            _i64,
            _ptr,
            _i64,
            _ptr,
            _i64,
            _P(Parallel),
            _i32,
            _P(IndexCandidates),
        ],
    ),
    "dsv4_indexer_isa": (ctypes.c_int, [_i32, _i32, _i32]),
    "dsv4_cpu_best_isa": (ctypes.c_int, [_i32]),
    "dsv4_cpu_isa_name": (ctypes.c_char_p, [_i32]),
    "dsv4_cpu_isa_supported": (ctypes.c_int, [_i32]),
    "dsv4_cpu_decode_row": (ctypes.c_int, [_i32, _ptr, _ptr, _ptr]),
    "dsv4_decode_row_bf16": (None, [_ptr, _ptr, _ptr]),
    "dsv4_cpu_last_error": (ctypes.c_char_p, []),
    "dsv4_cpu_abi": (ctypes.c_int, []),
}

_lock = threading.RLock()
_state: dict = {}


def library() -> ctypes.CDLL:
    """The kernels' library (built on first use), its functions typed. Raises RuntimeError when
    it cannot be built or loaded here (`unavailable_reason()` is the non-raising check)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        if "error" in _state:
            raise RuntimeError(_state["error"])
        try:
            lib = ctypes.CDLL(build.build_kernels())
            for name, (restype, argtypes) in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            if lib.dsv4_cpu_abi() != ABI:
                raise RuntimeError(f"the library's ABI is {lib.dsv4_cpu_abi()}, this binding's {ABI}")
            names = tuple(lib.dsv4_cpu_isa_name(i).decode() for i in range(len(ISAS)))
            if names != ISAS:
                raise RuntimeError(f"the library's instruction sets {names} differ from the binding's {ISAS}")
        except Exception as e:  # noqa: BLE001 - any build or load failure is the reason
            _state["error"] = f"{type(e).__name__}: {e}"
            raise RuntimeError(_state["error"]) from None
        _state["lib"] = lib
        return lib


def unavailable_reason() -> str | None:
    """None when the kernels are built (or build now); else why they cannot run here."""
    try:
        library()
    except RuntimeError as e:
        return str(e)
    return None


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


def bf16_matmul_native(flags: str | None = None) -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16), the ones a
    framework's bf16 GEMM (torch's oneDNN / MKL, XLA's Eigen) needs to run at speed; without them
    it emulates bf16 (0.3 GFLOP/s for torch's 2048^3 bf16 matmul on a Zen 3 against 132 for
    fp32). `flags`: a /proc/cpuinfo flags line (default: this machine's)."""
    from dsv4_cpu.build import cpu_flags

    have = set((flags if flags is not None else cpu_flags()).replace(":", " ").split())
    return bool(have & {"avx512_bf16", "amx_bf16"})


def kernel_isas() -> dict[str, dict]:
    """Each kernel of the library -> {"isa": the instruction set a call runs here (capped by
    DSV4_PREFILL_CPU_ISA), "bf16_dot": whether it multiplies bf16 with bf16 dot-product
    instructions (else it widens bf16 to float32 and runs float32 FMAs, bit-exact products)}."""
    lib = library()
    out = {}
    for name, dtype in (("attention bf16", BF16), ("attention float32", F32)):
        isa = best_isa(dtype)
        out[name] = dict(isa=isa, bf16_dot=dtype == BF16 and isa == "avx512bf16")
    for name, q, k in (
        ("indexer fp8", INDEX_FP8, INDEX_FP8),
        ("indexer bf16", BF16, BF16),
        ("indexer float32", F32, F32),
    ):
        code = lib.dsv4_indexer_isa(q, k, -1)
        if code < 0:
            raise RuntimeError(f"dsv4_indexer_isa({q}, {k}): {lib.dsv4_cpu_last_error().decode()}")
        isa = ISAS[code]
        out[name] = dict(isa=isa, bf16_dot=q != F32 and isa == "avx512bf16")
    return out


def isa_code(isa: str | None) -> int:
    """dsv4_cpu.h's number of an instruction set name (None: -1, the best allowed)."""
    if isa is None:
        return -1
    if isa not in ISAS:
        raise ValueError(f"isa: expected one of {', '.join(ISAS)} or None, got {isa!r}")
    return ISAS.index(isa)


def kind_code(kind: str) -> int:
    """dsv4_cpu.h's code of a layer kind name ("SWA", "CSA", "HCA")."""
    if kind not in KIND_CODES:
        raise ValueError(f"kind: expected one of {', '.join(KIND_CODES)}, got {kind!r}")
    return KIND_CODES[kind]


def parallel(threads: int, run: int | None = None) -> Parallel:
    """A `dsv4_parallel` for `threads` threads: on the fork-join function at address `run` (e.g.
    torch's `dsv4_torch_parallel_run`), or on the library's own pool when `run` is None."""
    if int(threads) < 1:
        raise ValueError(f"threads: expected >= 1, got {threads!r}")
    return Parallel(int(threads), run, None, None)
