"""The backend "cpu": the C/C++ kernels of `dsv4_cpu` as XLA FFI custom calls.

The kernels torch calls through ctypes, here custom calls XLA runs on the host (usable under
`jax.jit`; indices, lengths and the prefill's metadata may be traced). The handlers
(`dsv4_cpu/csrc/xla_ffi.cc`) are built against jaxlib's FFI headers into a library linked
against the kernels' library (`dsv4_cpu.build.build_xla`), registered once per process as
custom-call targets on the CPU platform, and run their parallel work on XLA's intra-op thread
pool (never threads of their own):

- `sparse_attention`: FlashMLA's `flash_mla_sparse_fwd` contract on a flat workspace
  (`dsv4_sparse_attention`), returning (out, max_logits, lse).
- `prefill_attention`: one prefill layer straight from the caches (`dsv4_prefill_attention`):
  no workspace and no chunk loop; rows in q's dtype (paged or logical) or fp8_ds_mla pages,
  dequantized inside the kernel.
- `gather_dequant` / `gather_segments`: vLLM's `dequantize_and_gather_k_cache` (backend "cpu"
  of `dsv4_jax.kvcache`), and the prefill's gather of one workspace region.

Numerics (`dsv4_cpu/csrc/dsv4_cpu.h`): bf16 inputs: bf16 products, fp32 accumulation, the
probabilities rounded to bf16 before P @ V (FlashMLA's); float32 inputs: float32 throughout. A
token's result depends only on its own keys and their order, so torch and JAX get the same bits,
and a prefill's output does not depend on the plan. The instruction set is chosen at run time
(`DSV4_PREFILL_CPU_ISA` caps it, read on every call). Bounds: every page id, position and row is
checked by the kernels (a bad traced value gives a NaN row or an error, never a stray access).

There is no backward: taking a gradient through these calls raises NotImplementedError, never
a wrong or zero gradient.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_cpu import binding, build
from planner.contract import backend_unavailable

# custom-call target -> handler symbol in the library
TARGETS = {
    "dsv4_gather_dequant": "Dsv4GatherDequant",
    "dsv4_gather_segments": "Dsv4GatherSegments",
    "dsv4_sparse_attention": "Dsv4SparseAttention",
    "dsv4_prefill_attention": "Dsv4PrefillAttention",
    "dsv4_prefill_attention_into": "Dsv4PrefillAttentionInto",
    "dsv4_indexer_topk": "Dsv4IndexerTopk",  # dsv4_jax.kernels.cpu_indexer
}
GATHER_TARGET = "dsv4_gather_dequant"
SEGMENTS_TARGET = "dsv4_gather_segments"

_lock = threading.Lock()
_state: dict = {}


def ffi_library() -> str:
    """The path of the FFI handlers' library for this jaxlib (built on first use)."""
    import jaxlib

    return build.build_xla(jax.ffi.include_dir(), f"jaxlib {jaxlib.__version__}")


def _register() -> None:
    with _lock:
        if "ok" in _state or "error" in _state:
            return
        try:
            binding.library()  # the kernels first: the handlers' library links against them
            lib = ctypes.CDLL(ffi_library())
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _state["lib"] = lib  # keep the library loaded
            _state["ok"] = True
        except Exception as e:  # noqa: BLE001 - any build or registration failure is the reason
            _state["error"] = f"{type(e).__name__}: {e}"


def unavailable_reason() -> str | None:
    """None when the FFI targets are registered (or register now); else why they cannot run here."""
    _register()
    return _state.get("error")


def require(backend: str = "cpu") -> None:
    """Raise BackendUnavailableError (saying why) when the FFI targets cannot run here."""
    if (reason := unavailable_reason()) is not None:
        raise backend_unavailable(backend, reason)


SPARSE_TARGET = "dsv4_sparse_attention"
PREFILL_TARGET = "dsv4_prefill_attention"
PREFILL_INTO_TARGET = "dsv4_prefill_attention_into"  # the same, writing into a given (donated) buffer
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Cache layouts of the prefill call (xla_ffi.cc's LAYOUT_*).
LAYOUT_LOGICAL, LAYOUT_PAGED, LAYOUT_FP8 = 0, 1, 2


def dtype_unavailable(dtype) -> str | None:
    """None when the kernel takes q of this dtype, else why not."""
    if jnp.dtype(dtype) in DTYPES:
        return None
    return f"the C kernel takes bfloat16 or float32 inputs, got {jnp.dtype(dtype)} (float16 runs backend='xla')"


def _no_backward(impl, what: str):
    """`impl` with a backward that raises: an FFI call has no derivative rule, and a gradient
    must never silently be wrong or zero."""
    f = jax.custom_vjp(impl)

    def fwd(*args):
        return impl(*args), None

    def bwd(_, g):
        raise NotImplementedError(f"{what}: backend='cpu' (the C kernel, an XLA FFI call) has no backward pass")

    f.defvjp(fwd, bwd)
    return f


@functools.cache
def _sparse_call(sm_scale: float):
    def impl(q, kv, indices, topk_length, sink):
        T, H, D = q.shape
        dv = 512 if D >= 512 else D
        stat = jax.ShapeDtypeStruct((T, H), jnp.float32)
        call = jax.ffi.ffi_call(
            SPARSE_TARGET, (jax.ShapeDtypeStruct((T, H, dv), q.dtype), stat, stat), vmap_method="sequential"
        )
        return call(q, kv, indices, topk_length, sink, sm_scale=np.float32(sm_scale))

    return _no_backward(impl, "sparse_attention")


def sparse_attention(q, kv, indices, sm_scale: float, attn_sink=None, topk_length=None):
    """(out, max_logits, lse) of `dsv4_jax.sparse_attention` by the C kernel. Inputs in the
    canonical form of `dsv4_jax.attention.check_inputs` (q (T, H, D) and kv (S, D) both bf16 or
    both float32, indices (T, K) int32, sink (H,) float32 or None, topk_length (T,) int32 or None)."""
    require()
    if (reason := dtype_unavailable(q.dtype)) is not None:
        raise backend_unavailable("cpu", reason)
    topk = jnp.zeros((0,), jnp.int32) if topk_length is None else topk_length.astype(jnp.int32)
    sink = jnp.zeros((0,), jnp.float32) if attn_sink is None else attn_sink.astype(jnp.float32)
    return _sparse_call(float(sm_scale))(q, kv, indices.astype(jnp.int32), topk, sink)


@functools.cache
def _prefill_call(attrs: tuple, into: bool):
    def impl(q, tokens, count, raw_data, raw_table, comp_data, comp_table, topk, sink, *out):
        T, H, D = q.shape
        dv = 512 if D >= 512 else D
        result = jax.ShapeDtypeStruct((T, H, dv), q.dtype)
        if into:
            call = jax.ffi.ffi_call(PREFILL_INTO_TARGET, result, vmap_method="sequential", input_output_aliases={9: 0})
        else:
            call = jax.ffi.ffi_call(PREFILL_TARGET, result, vmap_method="sequential")
        kw = {k: (np.float32(v) if k == "sm_scale" else np.int64(v)) for k, v in attrs}
        return call(q, tokens, count, raw_data, raw_table, comp_data, comp_table, topk, sink, *out, **kw)

    return _no_backward(impl, "prefill_attention")


def source_arrays(src):
    """(data, table, layout, block_size) of a prefill cache: a `dsv4_jax.prefill.PagedKV` (rows
    or fp8_ds_mla pages) or `LogicalKV` (rows + offsets); None: an empty stand-in (SWA's
    compressed cache)."""
    if src is None:
        return jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.int32), LAYOUT_LOGICAL, 0
    if hasattr(src, "block_table"):
        if src.fp8:
            return src.pages, src.block_table, LAYOUT_FP8, src.page_size
        return src.pages, src.block_table, LAYOUT_PAGED, 0
    return src.rows, src.offsets, LAYOUT_LOGICAL, 0


def prefill_attention(
    q,
    tokens,
    count,
    raw,
    comp,
    topk_rows,
    attn_sink,
    *,
    kind: str,
    window: int,
    compress_ratio: int,
    sm_scale: float,
    out=None,
):
    """One prefill layer by the C kernel: out (T_q, H, d_v) in q's dtype.

    tokens: (3, n) int32, per token: q row, batch request (block-table row / offsets entry),
    absolute position; the first `count` (a traced int32 scalar) are real, the rest padding
    (their rows, and every q row no real token names, come out 0). raw / comp: `PagedKV` or
    `LogicalKV` (comp None for SWA); topk_rows (rows, topk)
    int32 for CSA, else None; attn_sink (H,) float32 or None. out: optional (T_q, H, d_v) array in
    q's dtype that the kernel writes into (aliased to the result: donate it to reuse its memory)."""
    require()
    if (reason := dtype_unavailable(q.dtype)) is not None:
        raise backend_unavailable("cpu", reason)
    raw_data, raw_table, raw_layout, raw_bs = source_arrays(raw)
    comp_data, comp_table, comp_layout, comp_bs = source_arrays(comp)
    topk = jnp.zeros((0, 0), jnp.int32) if topk_rows is None else topk_rows.astype(jnp.int32)
    sink = jnp.zeros((0,), jnp.float32) if attn_sink is None else attn_sink.astype(jnp.float32)
    attrs = (
        ("kind", binding.kind_code(kind)),
        ("window", window),
        ("compress_ratio", compress_ratio),
        ("sm_scale", sm_scale),
        ("raw_layout", raw_layout),
        ("raw_block_size", raw_bs),
        ("comp_layout", comp_layout),
        ("comp_block_size", comp_bs),
    )
    count = jnp.reshape(jnp.asarray(count, jnp.int32), (1,))
    extra = () if out is None else (out,)
    return _prefill_call(attrs, out is not None)(
        q,
        tokens.astype(jnp.int32),
        count,
        raw_data,
        raw_table.astype(jnp.int32),
        comp_data,
        comp_table.astype(jnp.int32),
        topk,
        sink,
        *extra,
    )


# ----------------------------------------------------------------------------- gathers


def gather_dequant(out, k_cache, seq, glen, bt, S: int, offset: int):
    """out bf16 [R', rows, 512] with rows of the requests written (a new array; donate `out`
    to reuse its buffer): seq / glen / bt int32 ([R], [R], [R, B]), k_cache uint8 2-D pages."""
    require()
    call = jax.ffi.ffi_call(GATHER_TARGET, jax.ShapeDtypeStruct(out.shape, out.dtype), input_output_aliases={0: 0})
    i32 = jnp.int32
    return call(
        out, k_cache, seq.astype(i32), glen.astype(i32), bt.astype(i32), block_size=np.int64(S), offset=np.int64(offset)
    )


def gather_segments(
    ws, k_cache, block_table, region_start, seg_request, seg_row_base, start, s0, s1, dst_offset, S: int
):
    """The prefill's gather of one region of one chunk into the workspace `ws` (rows, 512), bf16
    or float32 (a new array, aliased): segment s in [s0, s1) owns region rows region_start[s] ..
    region_start[s + 1] - 1; its row j is entry start[s] + j (start None: j) of request
    seg_request[s], dequantized into ws row seg_row_base[s] + dst_offset + j. s0, s1,
    dst_offset may be traced; nothing outside the arrays is read or written."""
    require()
    i32 = jnp.int32
    start = jnp.zeros((1,), i32) if start is None else start.astype(i32)
    bounds = jnp.stack([jnp.asarray(s0, i32), jnp.asarray(s1, i32), jnp.asarray(dst_offset, i32)])
    call = jax.ffi.ffi_call(SEGMENTS_TARGET, jax.ShapeDtypeStruct(ws.shape, ws.dtype), input_output_aliases={0: 0})
    return call(
        ws,
        k_cache,
        block_table.astype(i32),
        region_start.astype(i32),
        seg_request.astype(i32),
        seg_row_base.astype(i32),
        start,
        bounds,
        block_size=np.int64(S),
    )
