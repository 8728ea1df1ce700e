"""Triton kernel of the prefill's workspace gather for caches in q's dtype (paged or packed).

`gather_rows(out, src, seq_lens, gather_lens, index, page_size, offset)`: the twin of
`triton_kvcache.gather_dequant` without the dequantization. Grid (requests, workers); program
(b, w) copies rows i = w*BLOCK_R.., w + workers, ... < gather_lens[b] of request b: position
p = seq_lens[b] - gather_lens[b] + i, read from page index[b, p // S] slot p % S of `src`
(paged: (num_pages, S, D)) or row index[b] + p (packed: (rows, D)), written to out[b, offset + i].
Only the per-request arrays are read: no per-row maps exist anywhere. A copy, so the bits are
the source's on every device.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(
    out_ptr,  # [R', rows, D], last dim contiguous
    stride_ob,
    stride_or,
    src_ptr,  # paged: [num_pages, S, D]; packed: [rows, D]; last dim contiguous
    stride_sp,  # paged: page stride; packed: row stride
    stride_ss,  # paged: slot stride
    seq_ptr,
    glen_ptr,
    idx_ptr,  # paged: block table rows [R, max_pages]; packed: offsets [R]
    stride_idx,
    offset,
    D: tl.constexpr,
    S: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_GLEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    if not PAGED:
        base = tl.load(idx_ptr + b).to(tl.int64)
    for blk in range(w, tl.cdiv(g, BLOCK_R).to(tl.int32), workers):
        i = blk * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        ok = i < g
        pos = start + i
        if PAGED:
            page = tl.load(idx_ptr + b * stride_idx + pos // S, mask=ok, other=0).to(tl.int64)
            src = page * stride_sp + (pos % S) * stride_ss
        else:
            src = (base + pos) * stride_sp
        m = ok[:, None] & dm[None, :]
        x = tl.load(src_ptr + src[:, None] + d[None, :], mask=m)
        tl.store(out_ptr + b * stride_ob + (offset + i)[:, None] * stride_or + d[None, :], x, mask=m)


def gather_rows(
    out,
    src,
    seq_lens,
    gather_lens,
    index,
    page_size,
    offset: int,
    *,
    block_r: int = 32,
    workers: int | None = None,
    num_warps: int = 4,
):
    """Launch on checked arguments: out (R', rows, D) and src in one dtype with unit stride in
    the last dim; seq_lens / gather_lens (R,) contiguous; index the block-table rows (R, max_pages)
    (page_size = S) or the per-request offsets (R,) (page_size None)."""
    from dsv4_torch.kernels.triton.kvcache import default_workers

    R = seq_lens.shape[0]
    if R == 0:
        return
    D = out.shape[-1]
    paged = page_size is not None
    nw = workers or default_workers(R, out.device)
    _gather_rows_kernel[(R, nw)](
        out,
        out.stride(0),
        out.stride(1),
        src,
        src.stride(0),
        src.stride(1) if paged else 0,
        seq_lens,
        gather_lens if gather_lens is not None else seq_lens,
        index,
        index.stride(0) if paged else 0,
        offset,
        D,
        S=page_size if paged else 1,
        PAGED=paged,
        HAS_GLEN=gather_lens is not None,
        BLOCK_R=block_r,
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=num_warps,
    )


def compile_for(arch: int, *, D: int = 512, S: int = 64, block_r: int = 32, num_warps: int = 4) -> dict[str, str]:
    """Ahead-of-time compile the kernel (paged and packed) for NVIDIA `arch`, no GPU needed (and
    TRITON_INTERPRET unset); returns their PTX. Pointers and strides taken as 16-byte aligned."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {
        "out_ptr": "*bf16",
        "stride_ob": "i64",
        "stride_or": "i64",
        "src_ptr": "*bf16",
        "stride_sp": "i64",
        "stride_ss": "i64",
        "seq_ptr": "*i64",
        "glen_ptr": "*i64",
        "idx_ptr": "*i32",
        "stride_idx": "i64",
        "offset": "i32",
    }
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n != "offset"}
    out = {}
    for paged in (True, False):
        const = {
            "D": D,
            "S": S if paged else 1,
            "PAGED": paged,
            "HAS_GLEN": True,
            "BLOCK_R": block_r,
            "BLOCK_D": triton.next_power_of_2(D),
        }
        src = ASTSource(_gather_rows_kernel, {**sig, **{k: "constexpr" for k in const}}, const, attrs)
        kernel = triton.compile(
            src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 1}
        )
        out["paged" if paged else "packed"] = kernel.asm["ptx"]
    return out


INTERPRETED = not isinstance(_gather_rows_kernel, triton.runtime.JITFunction)

__all__ = ["INTERPRETED", "compile_for", "gather_rows"]
