"""Triton kernels for vLLM's `fp8_ds_mla` KV cache pages (layout: `planner/kvcache.py`).

- `_quantize_insert_kernel`: one program per token: loads the token's 512 bf16 dims as an
  [8, 64] tile (rows 0..6 the e4m3 groups, row 7 the RoPE dims), computes each group's UE8M0
  exponent exactly from the float32 bits of its amax, writes 448 e4m3 bytes, 64 bf16 RoPE dims
  and 8 scale bytes (the 8th zero) into the token's slot.
- `_gather_dequant_kernel`: grid (requests, workers); each program walks blocks of BLOCK_R
  rows of one request (worker w takes blocks w, w + workers, ...), reads the rows' pages from
  the block table, and writes bf16 rows: e4m3 * 2^(byte - 127) for dims [0, 448), the RoPE
  dims copied. Only the per-request arrays (seq_lens, gather_lens, block_table) are read: no
  per-row metadata exists anywhere.

On ROCm and NVIDIA GPUs before sm_89 (no e4m3 instructions) and under the interpreter, the
e4m3 casts are integer math (`SOFT_FP8`, `HW_CAST=False`); Hopper and Blackwell use the hardware
conversions.

Under TRITON_INTERPRET=1 (CPU tensors) Triton's float32 -> e4m3 cast rounds wrongly when the
rounding carries into the exponent, its e4m3 -> float32 decode gets NaN codes and subnormals
wrong, and its float32 -> bf16 cast truncates: the interpreted path encodes and decodes e4m3
with integer math and rounds bf16 by hand, so its bytes and values equal the NumPy reference on
any input. `HW_CAST=True` forces the hardware-cast
branch (the GPU's) under the interpreter too, for tests on exactly representable inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from planner import kvcache as ref


@triton.jit
def _e4m3_bits_rtne(q):
    """float32 in [-448, 448] -> OCP e4m3 bit pattern (uint8), round to nearest even (integer math)."""
    bits = q.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 (|q| >= 2^-6): keep 3 mantissa bits, ties to even; a carry bumps the exponent.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal (|q| < 2^-6): the multiple of 2^-9 nearest |q|, ties to even (8 = the smallest normal).
    a = mag.to(tl.float32, bitcast=True) * 512.0
    sub = ((a + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(mag >= (121 << 23), normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def _e4m3_to_f32(byte):
    """OCP e4m3 bit pattern (uint8) -> float32, integer math. Interpreter only (its decode is off)."""
    b = byte.to(tl.uint32)
    code = b & 0x7F
    sign = (b & 0x80) << 24
    normal = (sign | ((code << 20) + (120 << 23))).to(tl.float32, bitcast=True)
    sub = (code.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)  # code * 2^-9
    sub = (sub | sign).to(tl.float32, bitcast=True)
    x = tl.where(code >= 8, normal, sub)
    return tl.where(code == 0x7F, float("nan"), x)


@triton.jit
def _bf16_rtne(x):
    """float32 -> bfloat16, round to nearest even, by bits. Interpreter only (its cast truncates
    and flushes subnormals)."""
    bits = x.to(tl.uint32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, r)  # NaN stays NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _quantize_insert_kernel(
    k_ptr,  # [T, 512] bf16
    stride_kt,
    slot_ptr,  # [T'] int64
    cache_ptr,  # uint8 view of the pages
    cache16_ptr,  # the same memory as bf16 (RoPE dims)
    page_stride,  # bytes per page
    S: tl.constexpr,  # slots per page
    HW_CAST: tl.constexpr,  # the hardware float32 -> e4m3 cast (GPUs); else integer RTNE
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // S
        pos = slot % S
        grp = tl.arange(0, 8)
        lane = tl.arange(0, 64)
        d = grp[:, None] * 64 + lane[None, :]  # [8, 64]
        nope = (grp < 7)[:, None]
        x = tl.load(k_ptr + t * stride_kt + d).to(tl.float32)
        amax = tl.max(tl.where(nope, tl.abs(x), 0.0), axis=1)
        amax = tl.maximum(amax, 1e-4)
        # e = ceil(log2(amax / 448)) exactly: amax = (1 + f) 2^(E - 127), 448 = 1.75 * 2^8.
        abits = amax.to(tl.int32, bitcast=True)
        e = ((abits >> 23) & 0xFF) - 135 + ((abits & 0x7FFFFF) > 0x600000).to(tl.int32)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, e in [-22, 120]
        q = x * inv[:, None]
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        if HW_CAST:
            byte = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            byte = _e4m3_bits_rtne(q)
        base = page * page_stride
        tl.store(cache_ptr + base + pos * 576 + d, byte, mask=nope)
        rope = tl.load(k_ptr + t * stride_kt + 448 + lane)
        tl.store(cache16_ptr + (base + pos * 576 + 448) // 2 + lane, rope)
        sb = tl.where(grp < 7, tl.minimum(tl.maximum(e + 127, 0), 255), 0).to(tl.uint8)
        tl.store(cache_ptr + base + S * 576 + pos * 8 + grp, sb)


@triton.jit
def _gather_dequant_kernel(
    out_ptr,  # [R', rows, 512] bf16, last dim contiguous
    stride_ob,
    stride_or,
    cache_ptr,  # uint8 view of the pages
    cache16_ptr,  # the same memory as bf16
    page_stride,
    seq_ptr,  # [R] int32/int64
    glen_ptr,  # [R] (read when HAS_GLEN)
    bt_ptr,  # [R'', max_blocks] int32/int64
    stride_bt,
    offset,
    S: tl.constexpr,
    HAS_GLEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SOFT_FP8: tl.constexpr,  # e4m3 decode and bf16 rounding by integer math (interpreter, < sm_89)
):
    b = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    workers = tl.num_programs(1)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    if HAS_GLEN:
        g = tl.load(glen_ptr + b).to(tl.int64)
    else:
        g = seq
    start = seq - g
    grp = tl.arange(0, 8)
    lane = tl.arange(0, 64)
    d = grp[:, None] * 64 + lane[None, :]  # [8, 64]
    nope = (grp < 7)[None, :, None]
    for blk in range(w, tl.cdiv(g, BLOCK_R).to(tl.int32), workers):
        i = blk * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        ok = i < g
        pos = start + i
        page = tl.load(bt_ptr + b * stride_bt + pos // S, mask=ok, other=0).to(tl.int64)
        base = page * page_stride + (pos % S) * 576  # slot data, bytes
        sbase = page * page_stride + S * 576 + (pos % S) * 8  # slot scales
        m3 = ok[:, None, None] & nope
        byte = tl.load(cache_ptr + base[:, None, None] + d[None, :, :], mask=m3, other=0)
        sb = tl.load(cache_ptr + sbase[:, None] + grp[None, :], mask=ok[:, None], other=127).to(tl.int32)
        # 2^(sb - 127) exactly: the float32 with exponent field sb (sb = 0: 2^-127, a subnormal)
        scale = tl.where(sb == 0, 0x400000, sb << 23).to(tl.float32, bitcast=True)
        if SOFT_FP8:
            y = _bf16_rtne(_e4m3_to_f32(byte) * scale[:, :, None])
        else:
            y = (byte.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]).to(tl.bfloat16)
        orow = out_ptr + b * stride_ob + (offset + i) * stride_or  # [BLOCK_R]
        tl.store(orow[:, None, None] + d[None, :, :], y, mask=m3)
        rope = tl.load(cache16_ptr + (base + 448)[:, None] // 2 + lane[None, :], mask=ok[:, None])
        tl.store(orow[:, None] + 448 + lane[None, :], rope, mask=ok[:, None])


INTERPRETED = not isinstance(_gather_dequant_kernel, triton.runtime.JITFunction)


def soft_fp8(device: torch.device) -> bool:
    """Whether the kernels must do e4m3 in integers on `device`: under the interpreter (its casts
    are wrong), on ROCm (float8e4nv is the OCP type; gfx942 has FNUZ hardware) and on NVIDIA GPUs
    before sm_89 (no e4m3 conversion instructions)."""
    if INTERPRETED or device.type != "cuda":
        return True
    if torch.version.hip is not None:
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)


def _cache_views(k_cache: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(uint8 pointer view, bf16 pointer view, page stride in bytes) of a checked page tensor."""
    flat = k_cache.view(torch.uint8)
    return flat, flat.view(torch.bfloat16), ref.page_bytes(S)


def quantize_insert(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor, S: int, *, hw_cast=None):
    """Launch the writer on checked arguments (k bf16 [T, 512] unit stride in dim 1)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    u8, b16, stride = _cache_views(k_cache, S)
    _quantize_insert_kernel[(n,)](
        k,
        k.stride(0),
        slot_mapping,
        u8,
        b16,
        stride,
        S=S,
        HW_CAST=(not soft_fp8(k.device)) if hw_cast is None else bool(hw_cast),
        num_warps=2,
    )


def default_workers(num_requests: int, device: torch.device) -> int:
    """Programs per request: enough for ~8 per SM in all (the per-request loop takes the rest)."""
    if num_requests == 0:
        return 1
    sms = 1
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(1024, -(-8 * sms // num_requests)))


def gather_dequant(
    out,
    k_cache,
    seq_lens,
    gather_lens,
    block_table,
    S: int,
    offset: int,
    *,
    block_r: int = 32,
    workers: int | None = None,
    num_warps: int = 4,
):
    """Launch the reader on checked arguments (out bf16 with unit stride in dim 2)."""
    R = seq_lens.shape[0]
    if R == 0:
        return
    u8, b16, stride = _cache_views(k_cache, S)
    nw = workers or default_workers(R, out.device)
    _gather_dequant_kernel[(R, nw)](
        out,
        out.stride(0),
        out.stride(1),
        u8,
        b16,
        stride,
        seq_lens,
        gather_lens if gather_lens is not None else seq_lens,
        block_table,
        block_table.stride(0),
        offset,
        S=S,
        HAS_GLEN=gather_lens is not None,
        BLOCK_R=block_r,
        SOFT_FP8=soft_fp8(out.device),
        num_warps=num_warps,
    )


def compile_for(arch: int, *, S: int = 64, block_r: int = 32, num_warps: int = 4) -> dict[str, str]:
    """Ahead-of-time compile both kernels for NVIDIA `arch` (90 = H100/H200), no GPU needed (and
    TRITON_INTERPRET unset); returns their PTX. Pointers and strides are taken as 16-byte
    aligned, as Triton specializes them at launch (page strides are multiples of 576)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    soft = arch < 89

    def build(fn, sig, const, warps):
        sig = {**sig, **{k: "constexpr" for k in const}}
        names = [k for k, v in sig.items() if v != "constexpr"]
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n != "offset"}
        kernel = triton.compile(
            ASTSource(fn, sig, const, attrs),
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": warps, "num_stages": 1},
        )
        return kernel.asm["ptx"]

    common = {"cache_ptr": "*u8", "cache16_ptr": "*bf16", "page_stride": "i64"}
    insert_sig = {"k_ptr": "*bf16", "stride_kt": "i64", "slot_ptr": "*i64", **common}
    gather_sig = {
        "out_ptr": "*bf16",
        "stride_ob": "i64",
        "stride_or": "i64",
        **common,
        "seq_ptr": "*i32",
        "glen_ptr": "*i32",
        "bt_ptr": "*i32",
        "stride_bt": "i64",
        "offset": "i32",
    }
    return {
        "insert": build(_quantize_insert_kernel, insert_sig, {"S": S, "HW_CAST": not soft}, 2),
        "gather": build(
            _gather_dequant_kernel,
            gather_sig,
            {"S": S, "HAS_GLEN": True, "BLOCK_R": block_r, "SOFT_FP8": soft},
            num_warps,
        ),
    }


__all__ = ["INTERPRETED", "compile_for", "default_workers", "gather_dequant", "quantize_insert", "ref", "soft_fp8"]
