"""Sparse attention as a Triton kernel: the FlashMLA contract on GPUs FlashMLA does not serve.

One program handles one query token and a block of BLOCK_H heads. It walks the token's index
row in blocks of BLOCK_K columns, stopping at topk_length, gathers the KV rows those columns
name, and folds them into an online softmax. Accumulation is float32; for bf16/fp16 inputs
the two matmuls take bf16/fp16 operands (P is rounded like FlashMLA does), for float32 inputs
they run in full IEEE float32.

Head dim D splits into the value part [0, d_v) and a tail [d_v, D) (the 64 RoPE dims when
D = 576), so the accumulator is exactly d_v wide. The sink joins the denominator in the
epilogue, which keeps lse and max_logits sink-free as the contract requires.

On CPU tensors the kernel runs under Triton's interpreter, which needs TRITON_INTERPRET=1 in
the environment before this module is first imported (Triton reads it when `@triton.jit`
decorates). `INTERPRETED` says which mode this process got.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from planner.contract import BackendUnavailableError, value_dim

_LOG2E = 1.4426950408889634


@triton.jit
def _round_to_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), kept in float32. Interpreter only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _sparse_attention_kernel(
    q_ptr,  # [T, H, D]
    kv_ptr,  # [S, D]
    idx_ptr,  # [T, K] int32
    sink_ptr,  # [H] float32 (read only when HAS_SINK)
    topk_len_ptr,  # [T] int32 (read only when HAS_TOPK_LENGTH)
    out_ptr,  # [T, H, D_V]
    max_ptr,  # [T, H] float32
    lse_ptr,  # [T, H] float32
    stride_qt,
    stride_qh,
    stride_kvs,
    stride_it,
    stride_ot,
    stride_oh,
    stride_mt,
    S,
    H,
    K,
    scale_log2,  # sm_scale * log2(e): logits are kept in base 2
    D: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program, >= 16 for tl.dot
    BLOCK_K: tl.constexpr,  # index columns per step
    BLOCK_DV: tl.constexpr,  # next power of two >= D_V
    BLOCK_DT: tl.constexpr,  # next power of two >= D - D_V (0: no tail)
    HAS_SINK: tl.constexpr,
    HAS_TOPK_LENGTH: tl.constexpr,
    F32_DOT: tl.constexpr,  # float32 dot operands in IEEE precision (float32 inputs; interpreter)
    EMULATE_BF16: tl.constexpr,  # interpreter + bf16: round to bf16 by hand (its cast truncates)
    INTERPRETER: tl.constexpr,  # a custom-combine reduce runs per element in Python there: slow
):
    # 1-D grid, pid -> (token, head block) with a token's head blocks adjacent: they gather the
    # same KV rows, so the second one finds them in L2. (Grid axes y/z stop at 65,535; x does not.)
    head_blocks = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    t = (pid // head_blocks).to(tl.int64)
    head_block = pid % head_blocks

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < D_V
    q_rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q_main = tl.load(q_rows + dv[None, :], mask=head_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_DV]
    if F32_DOT:
        q_main = q_main.to(tl.float32)
    if BLOCK_DT > 0:
        dt = tl.arange(0, BLOCK_DT)
        dt_ok = dt < D - D_V
        q_tail = tl.load(
            q_rows + D_V + dt[None, :], mask=head_ok[:, None] & dt_ok[None, :], other=0.0
        )  # [BLOCK_H, BLOCK_DT]
        if F32_DOT:
            q_tail = q_tail.to(tl.float32)

    limit = K
    if HAS_TOPK_LENGTH:
        limit = tl.minimum(tl.maximum(tl.load(topk_len_ptr + t), 0), K)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of valid logits (base 2)
    l = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(logit - m)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    num_valid = tl.zeros([BLOCK_H], tl.int32)  # valid entries seen; a NaN logit must not pass for "no valid key"
    # Only blocks below topk_length can hold valid entries.
    for k0 in range(0, limit, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        in_row = cols < limit
        idx = tl.load(idx_ptr + t * stride_it + cols, mask=in_row, other=-1)  # [BLOCK_K]
        valid = in_row & (idx >= 0) & (idx < S)
        rows = kv_ptr + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kvs
        kv_main = tl.load(rows + dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_DV]
        if F32_DOT:
            kv_main = kv_main.to(tl.float32)
            s = tl.dot(q_main, tl.trans(kv_main), input_precision="ieee")
        else:
            s = tl.dot(q_main, tl.trans(kv_main))  # [BLOCK_H, BLOCK_K]
        if BLOCK_DT > 0:
            kv_tail = tl.load(
                rows + D_V + dt[None, :], mask=valid[:, None] & dt_ok[None, :], other=0.0
            )  # [BLOCK_K, BLOCK_DT]
            if F32_DOT:
                s += tl.dot(q_tail, tl.trans(kv_tail.to(tl.float32)), input_precision="ieee")
            else:
                s += tl.dot(q_tail, tl.trans(kv_tail))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        num_valid += tl.sum(valid.to(tl.int32), axis=0)

        # NaN-propagating max (hardware max.f32 drops NaN), so a NaN logit gives max_logits NaN.
        if INTERPRETER:  # the same values, vectorized: the plain max, then NaN where a logit is NaN
            block_max = tl.max(s, axis=1)
            block_max = tl.where(tl.sum((s != s).to(tl.int32), axis=1) > 0, float("nan"), block_max)
        else:
            block_max = tl.reduce(s, 1, _max_propagating_nan)
        m_new = tl.maximum(m, block_max, propagate_nan=tl.PropagateNan.ALL)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep everything 0, not NaN
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        # P is rounded to the input dtype before the PV matmul, as FlashMLA does. The rescaled
        # accumulator goes in as the dot's accumulator: no second BLOCK_H x BLOCK_DV fp32 temporary.
        acc = acc * alpha[:, None]
        if EMULATE_BF16:
            acc = tl.dot(_round_to_bf16(p), kv_main, acc, input_precision="ieee")
        elif F32_DOT:
            acc = tl.dot(p.to(kv_ptr.dtype.element_ty).to(tl.float32), kv_main, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(kv_ptr.dtype.element_ty), kv_main, acc)
        m = m_new

    # Decided by count, not by l > 0: a NaN logit makes l NaN, and the row must come out NaN
    # (as planner.oracle does), not as "no valid key".
    has_key = num_valid > 0
    m_ref = tl.where(has_key, m, 0.0)
    l_ref = tl.where(has_key, l, 1.0)
    denom = l_ref
    if HAS_SINK:
        # out *= exp(lse) / (exp(lse) + exp(sink)), i.e. divide by l + exp(sink - max).
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=float("-inf"))
        denom += tl.exp2(sink * 1.4426950408889634 - m_ref)  # log2(e)
    out = tl.where(has_key[:, None], acc / denom[:, None], 0.0)
    lse = tl.where(has_key, (m_ref + tl.log2(l_ref)) * 0.6931471805599453, float("inf"))  # ln(2): back to base e
    max_logit = tl.where(has_key, m * 0.6931471805599453, float("-inf"))

    if EMULATE_BF16:
        out = _round_to_bf16(out)
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dv_ok[None, :],
    )
    tl.store(max_ptr + t * stride_mt + heads, max_logit, mask=head_ok)
    tl.store(lse_ptr + t * stride_mt + heads, lse, mask=head_ok)


INTERPRETED = not isinstance(_sparse_attention_kernel, triton.runtime.JITFunction)
TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])
# Interpreters before Triton 3.9 cannot run a loop bounded by a loaded value (topk_length):
# "only 0-dimensional arrays can be converted to Python scalars". Compiled kernels are unaffected.
INTERPRETER_UNSUPPORTED = (
    f"Triton {triton.__version__}'s interpreter cannot run this kernel (needs Triton >= 3.9 on CPU)"
    if INTERPRETED and TRITON_VERSION < (3, 9)
    else None
)


@dataclass(frozen=True)
class TritonConfig:
    """Launch configuration. block_h, block_k: powers of two >= 16 (tl.dot); num_warps: a power of two."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        # Checked here, so a bad value names its field instead of failing inside Triton's compiler.
        for name, low in (("block_h", 16), ("block_k", 16), ("num_warps", 1), ("num_stages", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"TritonConfig.{name}: expected an int >= {low}, got {value!r}")
            if name != "num_stages" and value & (value - 1):
                raise ValueError(f"TritonConfig.{name}: must be a power of two, got {value}")


def default_config(
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    arch: int | None = None,
    triton_version: tuple[int, int] | None = None,
) -> TritonConfig:
    """A starting point per GPU generation, untuned for speed (bench/checks/gpu_torch.py sweeps).

    arch: compute capability as an int (90 = H100); None = unknown (treated like sm_80).
    triton_version: (major, minor) of the Triton that compiles; None = the installed one.
    Each program re-gathers the token's KV rows, so more heads per program means less gather
    traffic per flop; BLOCK_H = 64 lets Triton use wgmma on sm_90 and tcgen05 on sm_100 (M >= 64).
    Chosen so no register spills sit in the key loop (bench/checks/triton_resources_torch.py, bf16,
    Triton 3.9, regs / spill bytes / loop LDL+STL / shared memory):

      arch    D    config (BLOCK_H, BLOCK_K, warps, stages)   regs  spill  loop  smem
      sm_80   512  32, 32, 8, 2  (mma.sync)                  181      0     0   67712
      sm_80   576  32, 32, 8, 2                              183      0     0   75904
      sm_90   512  64, 16, 8, 2  (wgmma)                     255      0     0   98368
      sm_90   576  64, 16, 8, 2                              255     32     0  110656
      sm_100  512  64, 32, 8, 2  (tcgen05)                   235      0     0  164512
      sm_100  576  64, 32, 8, 2                              247      0     0  144040
      sm_120  512  32, 32, 8, 2  (mma.sync, ~100 KB smem)    180      0     0   67712
      sm_120  576  32, 32, 8, 2                              186      0     0   75904
      any     576  16, 16, 8, 2  (float32 inputs)        122-128      0     0   74944

    On sm_90 the 64 x 512 float32 accumulator lives in registers (128 a thread at 8 warps), so
    BLOCK_K = 32 spills inside the loop (52 B at D=512, 92 B at D=576) and BLOCK_K = 64 more;
    16 warps cap registers at 128 and spill hundreds of bytes. The 32 B at sm_90/D=576 are
    loop-invariant values stored before the loop and reloaded after it. sm_100 keeps the
    accumulator in tensor memory, hence BLOCK_K = 32 there.

    Triton 3.6 (what torch 2.11 ships) allocates registers differently on sm_90: there
    64, 16, 8, 2 spills 140 B / 224 B (58 / 97 spill ops in the loop) and 64, 16, 8, 1 spills
    nothing (221 / 220 registers, 81920 / 92160 B shared memory), while on Triton 3.9 it is the
    other way round (one stage spills 68 B / 64 B in the loop). Hence one stage before 3.9.
    """
    big = head_dim >= 256
    if big and dtype == torch.float32:  # IEEE fp32 dots on CUDA cores; BLOCK_K = 32 spills on sm_80
        return TritonConfig(block_h=16, block_k=16, num_warps=8, num_stages=2)
    if num_heads <= 16:
        return TritonConfig(block_h=16, block_k=32 if big else 64, num_warps=8 if big else 4, num_stages=2)
    wide = num_heads >= 64 and dtype != torch.float32 and arch in (90, 100, 103)  # wgmma / tcgen05
    if not big:  # small test dims: nothing near the register limit
        return TritonConfig(block_h=64 if wide else 32, block_k=64, num_warps=4, num_stages=2)
    if wide and arch == 90:
        stages = 2 if (triton_version or TRITON_VERSION) >= (3, 9) else 1
        return TritonConfig(block_h=64, block_k=16, num_warps=8, num_stages=stages)
    if wide:
        return TritonConfig(block_h=64, block_k=32, num_warps=8, num_stages=2)
    return TritonConfig(block_h=32, block_k=32, num_warps=8, num_stages=2)


def sparse_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    config: TritonConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA sparse attention, Triton kernel.

    Args:
      q: (T, H, D), bfloat16 / float16 / float32, on a CUDA/ROCm device (CPU under the interpreter).
      kv: (S, D), q.dtype. V is the first d_v = (512 if D >= 512 else D) dims of a row.
      indices: (T, K), int32. Invalid: negative, >= S, or column >= topk_length[t].
      sm_scale: float.
      attn_sink: optional (H,), float32 (float64 is rounded to float32).
      topk_length: optional (T,), int32.
      config: launch configuration; `default_config(H, D, q.dtype, arch)` when None.

    Returns:
      out (T, H, d_v) q.dtype, max_logits (T, H) float32, lse (T, H) float32, as the contract.

    Non-contiguous q, kv or indices are copied to contiguous first (the kernel wants unit
    stride in the last dim).
    """
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q: the triton backend takes bfloat16, float16 or float32, got {q.dtype}")
    if q.device.type == "cpu" and not INTERPRETED:
        raise BackendUnavailableError(
            "backend='triton' got CPU tensors, but Triton's interpreter is off: set TRITON_INTERPRET=1 "
            "before dsv4_torch.kernels.triton.attention is first imported, or use a CUDA/ROCm device"
        )
    if q.device.type == "cpu" and INTERPRETER_UNSUPPORTED:
        raise BackendUnavailableError(f"backend='triton' on CPU tensors: {INTERPRETER_UNSUPPORTED}")
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    d_v = value_dim(D)
    arch = None
    if q.device.type == "cuda" and torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability(q.device)
        arch = 10 * major + minor
    cfg = config or default_config(H, D, q.dtype, arch)
    if not isinstance(cfg, TritonConfig):
        raise TypeError(f"config: expected a TritonConfig, got {type(cfg).__name__}")
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    dev = q.device
    out = torch.empty((T, H, d_v), dtype=q.dtype, device=dev)
    max_logits = torch.empty((T, H), dtype=torch.float32, device=dev)
    lse = torch.empty((T, H), dtype=torch.float32, device=dev)
    if T == 0 or H == 0:
        return out, max_logits, lse
    sink = attn_sink.to(torch.float32).contiguous() if attn_sink is not None else max_logits  # dummy pointer
    tlen = topk_length.contiguous() if topk_length is not None else indices  # dummy pointer
    tail = D - d_v
    grid = (T * triton.cdiv(H, cfg.block_h),)  # 1-D: axis y would cap T at 65,535
    _sparse_attention_kernel[grid](
        q,
        kv,
        indices,
        sink,
        tlen,
        out,
        max_logits,
        lse,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        max_logits.stride(0),
        S,
        H,
        K,
        float(sm_scale) * _LOG2E,
        D=D,
        D_V=d_v,
        BLOCK_H=cfg.block_h,
        BLOCK_K=cfg.block_k,
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_DT=0 if tail == 0 else max(16, triton.next_power_of_2(tail)),
        HAS_SINK=attn_sink is not None,
        HAS_TOPK_LENGTH=topk_length is not None,
        # Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584):
        # there, feed the dots float32 copies of the (exactly representable) 16-bit values.
        F32_DOT=q.dtype == torch.float32 or INTERPRETED,
        # ... and its float32 -> bf16 cast truncates instead of rounding to nearest.
        EMULATE_BF16=INTERPRETED and q.dtype == torch.bfloat16,
        INTERPRETER=INTERPRETED,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, max_logits, lse
