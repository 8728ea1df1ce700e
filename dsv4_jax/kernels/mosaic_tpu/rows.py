"""The pieces both Pallas TPU kernels of backend "mosaic_tpu" share (`dsv4_jax.kernels.mosaic_tpu.attention`).

* Chips and block shapes: `block_shapes` picks the key block and the query tile per TPU generation
  from `pltpu.get_tpu_info_for_chip` (VMEM size, MXU width); `target_chip` says which chip a call
  compiles for (a TPU device here, or `compile_target("v6e")` to compile for one from a CPU).
* Row sources: how the key rows of one array are fetched by DMA from HBM into VMEM and turned into
  the (BK, D) block the MXU reads: a flat workspace or packed rows `(1, S, D)`, pages of rows
  `(P, page_size, D)`, or vLLM's fp8_ds_mla pages seen as rows of 144 bytes `(P, page_bytes / 144,
  144)` uint8 (`fp8_slot_rows`: slot s is rows 4s .. 4s+3, the scale bytes follow the S slots),
  dequantized in VMEM.
* The online-softmax update of a block and the finalization (sink, lse, max_logits, no-key rows).

Why DMAs move aligned groups of rows: HBM and VMEM arrays are tiled, and a DMA's window must start
and end on the packing of its dtype in the second-minor dim (1 row for 32-bit, 2 for bf16, 4 for
8-bit types; checked with libtpu). A bf16 row therefore comes with its pair partner: each pair
lands in its own slot of a (2 * BK, D) buffer and the row is picked by a shift of the 32-bit words
the pair shares. An fp8_ds_mla slot is 576 bytes = 4 rows of 144: exactly one packed group, so a
gathered slot moves its own bytes and nothing else; the 4 rows share each 32-bit word (row k in
byte k), so the slot's 576 bytes in order are the 4 byte planes of its 144 words side by side.
Its 7 scale bytes sit in the page's scale rows (4 rows of 144 per 72 slots, after the slots): the
kernel copies the scale rows of the pages a phase can read into VMEM once per query tile
(`fp8_resident_scratch`, one DMA per page), and each gathered slot takes its 4-row scale group from
there by a VMEM-to-VMEM DMA: HBM moves 576 bytes per gathered key plus 576 per page per tile. An
invalid entry DMAs a zero group instead (same size, so one wait covers a block; from VMEM for fp8
slots), so garbage or NaN in rows nobody references never reaches an output.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from dsv4_jax.kernels.xla.kvcache import dequant_bits_exact
from planner import kvcache as KV
from planner.contract import D_V

NEG_INF = float("-inf")

# ----------------------------------------------------------------------------- chips


def _chip_versions():
    from jax.experimental.pallas import tpu as pltpu

    C = pltpu.ChipVersion
    return {"v4": C.TPU_V4, "v5e": C.TPU_V5E, "v5p": C.TPU_V5P, "v6e": C.TPU_V6E, "7x": C.TPU_7X}


CHIPS = ("v4", "v5e", "v5p", "v6e", "7x")
# device_kind strings of TPU devices (and of libtpu's compile-only topology devices) -> chip name
_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p"}
_KINDS |= {"TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "7x", "TPU 7x": "7x"}
INTERPRET_CHIP = "v5e"  # block shapes used in interpret mode (any chip would do; tests assume 128-wide)

_target = threading.local()


def chip_of_kind(device_kind: str) -> str | None:
    """Our chip name for a TPU device_kind ("TPU v5 lite" -> "v5e"), None if unknown."""
    return _KINDS.get(str(device_kind))


@contextlib.contextmanager
def compile_target(chip: str, *, vmem_limit: int | None = None):
    """Compile the mosaic_tpu kernels for `chip` ("v5e", "v6e", "v5p", "v4", "7x") inside this
    block, on a machine without that TPU (with libtpu installed: AOT compiles for a
    `jax.experimental.topologies` device). Also lets backend="mosaic_tpu" resolve here.
    vmem_limit: the scoped-VMEM limit given to Mosaic instead of `block_shapes`' (probes)."""
    if chip not in CHIPS:
        raise ValueError(f"chip: expected one of {CHIPS}, got {chip!r}")
    old = getattr(_target, "chip", None), getattr(_target, "vmem_limit", None)
    _target.chip, _target.vmem_limit = chip, vmem_limit
    try:
        yield chip
    finally:
        _target.chip, _target.vmem_limit = old


def compile_target_chip() -> str | None:
    return getattr(_target, "chip", None)


@contextlib.contextmanager
def override_block_k(block_k: int):
    """Calls inside use key blocks of `block_k` rows instead of the chip's MXU width (tests: TPU
    interpret mode simulates each DMA, and small blocks mean fewer of them)."""
    if isinstance(block_k, bool) or not isinstance(block_k, int) or block_k < 8 or block_k % 8:
        raise ValueError(f"block_k: expected a positive multiple of 8, got {block_k!r}")
    old = getattr(_target, "block_k", None)
    _target.block_k = block_k
    try:
        yield block_k
    finally:
        _target.block_k = old


def block_k_override() -> int | None:
    return getattr(_target, "block_k", None)


def tpu_device_chip() -> str | None:
    """The chip of JAX's first device when it is a TPU, else None."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:  # pragma: no cover - broken installs
        return None
    if dev.platform != "tpu":
        return None
    return chip_of_kind(dev.device_kind) or "v5e"


def target_chip() -> str | None:
    """The chip the compiled kernels target: `compile_target`'s, else the TPU's here, else None."""
    return compile_target_chip() or tpu_device_chip()


@functools.cache
def chip_info(chip: str):
    """`pltpu.get_tpu_info_for_chip` for our chip name (per TensorCore)."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.get_tpu_info_for_chip(_chip_versions()[chip], 1)


@dataclass(frozen=True)
class BlockShapes:
    """Static block shapes of one kernel call (see `block_shapes`)."""

    chip: str
    block_k: int  # key rows per block: the N of QK^T and the K of PV (the MXU width)
    vmem_limit: int  # bytes Mosaic may allocate (scoped VMEM), below the chip's VMEM
    vmem_capacity: int  # the chip's VMEM per TensorCore


def block_shapes(chip: str | None = None, block_k: int | None = None) -> BlockShapes:
    """The block shapes for `chip` (None: interpret mode, `INTERPRET_CHIP`'s); a call passes them to
    its jitted kernel as one static argument, so a change of chip, block or limit recompiles.

    block_k = the MXU width (`mxu_column_size`: 128 on v4 / v5e / v5p, 256 on v6e / 7x), so that
    one key block fills one MXU pass of QK^T (N) and of PV (K). The VMEM limit given to Mosaic is
    3/4 of the chip's VMEM (16 MiB on v4, 64 MiB on v5p / 7x, 128 MiB on v5e / v6e), leaving room
    for Mosaic's internal scratch; `vmem_bytes` of the prefill kernel checks its tiles against it.
    """
    info = chip_info(chip or INTERPRET_CHIP)
    bk = int(block_k or block_k_override() or info.mxu_column_size)
    limit = getattr(_target, "vmem_limit", None) if chip is not None else None
    limit = int(limit or info.vmem_capacity_bytes * 3 // 4)
    return BlockShapes(chip or INTERPRET_CHIP, bk, limit, int(info.vmem_capacity_bytes))


# ----------------------------------------------------------------------------- small vector helpers


def col(row):
    """(1, n) 32-bit row vector -> (n, 1) column (a transpose of its (8, n) broadcast)."""
    n = row.shape[1]
    return jnp.transpose(jnp.broadcast_to(row, (8, n)))[:, :1]


def row_of(column):
    """(n, 1) 32-bit column -> (1, n) row."""
    n = column.shape[0]
    return jnp.transpose(jnp.broadcast_to(column, (n, 128)))[:1, :]


def row_at(ref, t, cols):
    """Row t (dynamic) of an (n, W) 32-bit VMEM ref, columns `cols`, as a (1, w) vector: the
    aligned 8-row tile is loaded and the row picked by a masked sum (v5e / v5p cannot load a
    single row at a dynamic sublane offset)."""
    from jax.experimental import pallas as pl

    base = pl.multiple_of(t & ~7, 8)
    tile = ref[pl.ds(base, 8), cols]
    pick = lax.broadcasted_iota(jnp.int32, tile.shape, 0) == (t & 7)
    return jnp.sum(jnp.where(pick, tile, 0), axis=0, keepdims=True)


def sublanes(dtype) -> int:
    """Rows per (8, 128) tile's packing: 8 for 32-bit, 16 for bf16 (pad heads to this)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def packing(dtype) -> int:
    """Rows a DMA window must move together: 1 (32-bit), 2 (16-bit), 4 (8-bit)."""
    return 4 // jnp.dtype(dtype).itemsize


# ----------------------------------------------------------------------------- row sources


@dataclass(frozen=True)
class RowSource:
    """How the rows of one HBM array are gathered (static; the array is (P, rows_per_page, width)).

    paged: entry e of request b is row e % page_size of page block_table[b, e // page_size];
      else row offset_b + e of the single page (a flat workspace: offset 0).
    fp8: the array holds fp8_ds_mla pages as rows of 144 bytes (`fp8_slot_rows`: slot s in rows
      4s .. 4s+3, then the scale rows from 4 * page_size); slots dequantize to D = 512.
    group: rows per data DMA (the dtype's packing, 4 rows per fp8 slot, or rows_per_page for whole
      pages of bf16 rows when the page size is odd).
    """

    paged: bool
    fp8: bool
    page_size: int  # entries per page (paged; else unused)
    rows_per_page: int
    width: int  # D, or 144 bytes for fp8
    dtype: str  # the array's dtype name
    group: int
    whole_page: bool

    @property
    def scale_groups(self) -> int:
        """fp8: 4-row scale groups per page (one per 72 slots); else 0."""
        return self.rows_per_page // 4 - self.page_size if self.fp8 else 0

    @property
    def out_dim(self) -> int:
        return KV.HEAD_DIM if self.fp8 else self.width

    def data_shape(self, bk: int):
        """The double-buffered data buffer: groups packed 2-D (a group's rows share 32-bit words,
        so no tile padding), whole pages 3-D (one page per leading index)."""
        if self.whole_page:
            return (2, bk, self.rows_per_page, self.width)
        return (2, bk * self.group, self.width)

    def zero_arrays(self):
        """The zero window in HBM invalid entries are filled from (fp8: copied into VMEM once per
        tile, `zero_scratch`, and the slots' data and scale groups are filled from there)."""
        return [jnp.zeros((self.group, self.width), self.dtype)]


def rows_source(array_shape, dtype, *, paged: bool) -> RowSource:
    """A source over a (P, rows, D) float array: paged (pages of `rows` entries) or flat (P = 1)."""
    _, rows, width = array_shape
    g = packing(dtype)
    whole = paged and rows % g != 0
    return RowSource(paged, False, rows, rows, width, jnp.dtype(dtype).name, rows if whole else g, whole)


FP8_ROW = KV.SLOT_DATA_BYTES // 4  # 144: an fp8_ds_mla slot is 4 rows of this many bytes
SCALES_PER_GROUP = KV.SLOT_DATA_BYTES // KV.SLOT_SCALE_BYTES  # 72 slots' scale bytes per 576


def fp8_source(view_rows_per_page: int, slots: int) -> RowSource:
    """A source over fp8_ds_mla pages seen as (P, page_bytes / 144, 144) uint8, S = `slots` per page."""
    return RowSource(True, True, slots, view_rows_per_page, FP8_ROW, "uint8", 4, False)


def fp8_slot_rows(pages):
    """(P, page_bytes) (or (P, S, 584)) uint8 fp8_ds_mla pages -> (P, page_bytes / 144, 144): the
    same bytes as rows of 144, 4 rows per slot (free on CPU; a relayout on TPU unless the pages
    already live in that layout)."""
    P = pages.shape[0]
    return pages.reshape(P, -1, FP8_ROW)


def issue_row(src: RowSource, hbm, zeros, bufs, sems, slot, i, ok, page, row, scales=None):
    """Start the DMA(s) of one entry into slot `slot`, position i: row `row` of page `page` when
    `ok`, else zeros. All scalars. fp8: `scales` = (VMEM ref, first row) of the slot's 4-row
    scale group (a resident copy, `fp8_resident_scratch`); `zeros` a (4, 144) VMEM zero group."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    g = src.group
    if src.whole_page:
        window, data_buf = hbm.at[page], bufs[0].at[slot, i]
    else:
        start = pl.multiple_of(row * 4, 4) if src.fp8 else pl.multiple_of(row & ~(g - 1), g)
        window = hbm.at[page, pl.ds(start, g)]
        data_buf = bufs[0].at[slot, pl.ds(pl.multiple_of(i * g, g), g)]
    scale_buf = bufs[1].at[slot, pl.ds(pl.multiple_of(i * 4, 4), 4)] if src.fp8 else None

    @pl.when(ok)
    def _():
        pltpu.make_async_copy(window, data_buf, sems.at[slot, 0]).start()
        if src.fp8:
            ref, first = scales
            pltpu.make_async_copy(ref.at[pl.ds(pl.multiple_of(first, 4), 4)], scale_buf, sems.at[slot, 1]).start()

    @pl.when(jnp.logical_not(ok))
    def _():
        pltpu.make_async_copy(zeros[0], data_buf, sems.at[slot, 0]).start()
        if src.fp8:
            pltpu.make_async_copy(zeros[0], scale_buf, sems.at[slot, 1]).start()


def scale_group_row(src: RowSource, local_page, row):
    """fp8: the first row, in the resident scale copy, of the scale group of slot `row` of the
    copy's page `local_page` (pages are copied in order, `scale_groups` groups each)."""
    return (local_page * src.scale_groups + lax.div(row, SCALES_PER_GROUP)) * 4


def fp8_resident_scratch(src: RowSource, pages: int):
    """VMEM for the scale rows of `pages` pages of an fp8 source (4 rows of 144 per 72 slots each)."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.VMEM((max(pages, 1) * src.scale_groups * 4, FP8_ROW), jnp.uint8)


def copy_scale_rows(src: RowSource, hbm, resident, sem, page, local_page):
    """The DMA of page `page`'s scale rows into position `local_page` of the resident copy."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    n = src.scale_groups * 4
    dst = resident.at[pl.ds(pl.multiple_of(local_page * n, 4), n)]
    return pltpu.make_async_copy(hbm.at[page, pl.ds(src.page_size * 4, n)], dst, sem)


def zero_scratch(src: RowSource):
    """fp8: the (4, 144) VMEM zero group invalid slots are filled from (copied from HBM per tile)."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.VMEM((4, FP8_ROW), jnp.uint8)


def wait_rows(src: RowSource, bufs, sems, slot):
    """Wait for every DMA of a block (one wait per buffer: the semaphore counts bytes)."""
    from jax.experimental.pallas import tpu as pltpu

    pltpu.make_async_copy(bufs[0].at[slot], bufs[0].at[slot], sems.at[slot, 0]).wait()
    if src.fp8:
        pltpu.make_async_copy(bufs[1].at[slot], bufs[1].at[slot], sems.at[slot, 1]).wait()


CHUNK = 32  # gathered rows unpacked / dequantized per loop step (one step's code, looped)


def needs_decode(src: RowSource) -> bool:
    """Whether a block is unpacked into a keys buffer (packed groups, whole pages, fp8)."""
    return src.fp8 or src.whole_page or src.group > 1


def _pick(buf, slot, rows, sub, n, as_int: bool):
    """Row sub[i] (a (CH, 1) int32 column) of each page i in `rows` of buf[slot] (BK, n, W)."""
    out = None
    for r in range(n):
        x = buf[slot, rows, r, :]
        if as_int:
            x = x.astype(jnp.int32)
        out = x if out is None else jnp.where(sub == r, x, out)
    return out


def _unpack_group(buf, slot, rows, sub, g: int):
    """Row sub[i] of each group i in `rows` (group indices) of a packed (BK * g, W) buffer: the g
    rows of a group share each 32-bit word (row g*i + k in bits 16k or 8k), so a bitcast to
    uint32 and a shift pick it. Returns uint32 (CH, W): bf16 bits in the high half (g = 2), or
    the byte (g = 4)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    packed = buf[slot, pl.ds(pl.multiple_of(rows.start * g, g * 8), rows.size * g), :]
    w = pltpu.bitcast(packed, jnp.uint32)
    if g == 2:
        return jnp.where(sub == 0, w << 16, w & jnp.uint32(0xFFFF0000))
    return (w >> (8 * sub).astype(jnp.uint32)) & jnp.uint32(0xFF)


def _slot_bytes(buf, slot, rows):
    """The 576 bytes (int32 0..255, in order) of each fp8 slot in `rows` (slot indices) of a
    packed (4 * BK, 144) uint8 buffer: byte plane k of the slot's 144 words is its row k."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    packed = buf[slot, pl.ds(pl.multiple_of(rows.start * 4, 32), rows.size * 4), :]
    w = pltpu.bitcast(packed, jnp.uint32)
    return jnp.concatenate([((w >> (8 * k)) & jnp.uint32(0xFF)).astype(jnp.int32) for k in range(4)], axis=1)


def _slot_scales(buf, slot, rows, entry):
    """The 7 scale bytes ((CH, 1) int32 columns) of the slots `entry` (slot index in its page,
    (CH, 1)) from each one's 4-row scale group in `rows` of a packed (4 * BK, 144) buffer: slot
    j's bytes start at byte 8 (j % 72) of its group, i.e. in byte plane (j % 72) // 18 at lane
    8 (j % 18) (144 = 18 * 8: no slot's bytes straddle two rows)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    packed = buf[slot, pl.ds(pl.multiple_of(rows.start * 4, 32), rows.size * 4), :]
    w = pltpu.bitcast(packed, jnp.uint32)
    j = lax.rem(entry, SCALES_PER_GROUP)
    per_row = FP8_ROW // KV.SLOT_SCALE_BYTES  # 18 slots' scales per row of 144
    plane = ((w >> (8 * lax.div(j, per_row)).astype(jnp.uint32)) & jnp.uint32(0xFF)).astype(jnp.int32)
    lane = lax.broadcasted_iota(jnp.int32, plane.shape, 1)
    lane0 = KV.SLOT_SCALE_BYTES * lax.rem(j, per_row)
    return [jnp.sum(jnp.where(lane == lane0 + g, plane, 0), axis=1, keepdims=True) for g in range(KV.N_GROUPS)]


def _decode_chunk(src: RowSource, bufs, slot, rows, entry, compute_dtype):
    from jax.experimental.pallas import tpu as pltpu

    if not src.fp8:
        if src.whole_page:
            return _pick(bufs[0], slot, rows, entry, src.rows_per_page, False).astype(compute_dtype)
        bits = _unpack_group(bufs[0], slot, rows, entry & (src.group - 1), src.group)
        return pltpu.bitcast(bits, jnp.float32).astype(compute_dtype)
    scales = _slot_scales(bufs[1], slot, rows, entry)
    return decode_fp8(_slot_bytes(bufs[0], slot, rows), scales, compute_dtype)


def load_rows(src: RowSource, bufs, slot, entry, compute_dtype, scratch=None):
    """The gathered block (BK, out_dim) in `compute_dtype` from the buffers of `slot`.

    entry: (BK, 1) int32 column: each row's index inside its page (paged) or array row (flat),
    i.e. the `row` its DMA was issued with (any value for zero-filled rows). scratch: the
    (keys (BK, out_dim), entries (BK, 128) int32) VMEM buffers of `decode_scratch` when
    `needs_decode(src)`: the block is unpacked there in chunks of CHUNK rows.
    """
    from jax.experimental import pallas as pl

    if not needs_decode(src):
        return bufs[0][slot].astype(compute_dtype)
    keys, ent = scratch
    bk = keys.shape[0]
    ch = min(CHUNK, bk)
    ent[...] = jnp.broadcast_to(entry, ent.shape)

    def chunk(c, carry):
        rows = pl.ds(pl.multiple_of(c * ch, ch), ch)
        keys[rows, :] = _decode_chunk(src, bufs, slot, rows, ent[rows, :1], compute_dtype)
        return carry

    lax.fori_loop(0, bk // ch, chunk, 0)
    return keys[...]


def decode_scratch(src: RowSource, bk: int, compute_dtype):
    """The VMEM buffers `load_rows` unpacks a block into (none if the block is read as is)."""
    from jax.experimental.pallas import tpu as pltpu

    if not needs_decode(src):
        return []
    return [pltpu.VMEM((bk, src.out_dim), compute_dtype), pltpu.VMEM((bk, 128), jnp.int32)]


def decode_fp8(data, scale_bytes, compute_dtype):
    """Dequantize fp8_ds_mla slots in VMEM: data (BK, 576) int32 bytes, scale_bytes the 7 UE8M0
    bytes of each slot as (BK, 1) int32 columns -> (BK, 512) in compute_dtype, exactly
    `dsv4_jax.kvcache`'s values (e4m3 * 2^(scale - 127) rounded to bf16; RoPE dims copied)."""
    BK = data.shape[0]
    # the 7 scale bytes of each row, spread over the 64 lanes of their group
    lane512 = lax.broadcasted_iota(jnp.int32, (BK, KV.HEAD_DIM), 1)
    sb = jnp.zeros((BK, KV.HEAD_DIM), jnp.int32)
    for g, byte_g in enumerate(scale_bytes):
        sb = jnp.where((lane512 >> 6) == g, byte_g, sb)  # 64 dims per scale
    nope = dequant_bits_exact(data[:, : KV.HEAD_DIM], sb)  # bf16 bits; lanes >= 448 are replaced below
    rope = _rope_bits(data)  # (BK, 128): lanes 64.. hold dims 448..511
    lane128 = lax.broadcasted_iota(jnp.int32, (BK, 128), 1)
    tail = jnp.where(lane128 < KV.NOPE_DIM - 384, nope[:, 384:512], rope)
    bits = jnp.concatenate([nope[:, :384], tail], axis=1)
    vals = _bf16_bits_to_f32(bits)
    return vals.astype(compute_dtype)


def _bf16_bits_to_f32(bits):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.bitcast(bits << 16, jnp.float32)


def _rope_bits(data):
    """The 64 RoPE dims' bf16 bits (little-endian byte pairs at bytes 448..575), by two exact bf16
    matmuls that add each pair (lo + 256 * hi): (BK, 128), dim 448 + j in lane 64 + j."""
    BK = data.shape[0]

    def pair_matrix(rows, first_byte):
        k = lax.broadcasted_iota(jnp.int32, (rows, 128), 0) + first_byte  # byte index
        n = lax.broadcasted_iota(jnp.int32, (rows, 128), 1)
        lo = KV.NOPE_DIM + 2 * (n - 64)  # byte of dim 448 + (n - 64)
        m = jnp.where((n >= 64) & (k == lo), 1.0, jnp.where((n >= 64) & (k == lo + 1), 256.0, 0.0))
        return m.astype(jnp.bfloat16)

    def as_bf16(x):
        return x.astype(jnp.float32).astype(jnp.bfloat16)  # bytes 0..255: exact

    exact = dict(preferred_element_type=jnp.float32, precision=lax.Precision.DEFAULT)  # bf16 products are exact here
    a = jnp.dot(as_bf16(data[:, 384:512]), pair_matrix(128, 384), **exact)
    b = jnp.dot(as_bf16(data[:, 512:576]), pair_matrix(64, 512), **exact)
    del BK
    return (a + b).astype(jnp.int32)


# ----------------------------------------------------------------------------- online softmax


def precision_for(dtype):
    """HIGHEST for fp32 operands (6-pass bf16 on the MXU), DEFAULT for bf16: explicit, so that a
    caller's `jax.default_matmul_precision` cannot ask Mosaic for an fp32 product of bf16 tiles."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def softmax_update(acc_ref, m_ref, l_ref, rows, q, k, valid, sm_scale: float, d_v: int):
    """One key block into the running softmax of state rows `rows` (a pl.ds).

    q (M, D), k (BK, D) in the compute dtype; valid (M or 1, BK) bool. Masked logits are -inf, so
    a block with no valid key for a row leaves that row's state exactly as it was (alpha = 1,
    p = 0): results do not depend on which other rows share a block, or on empty blocks.
    """
    prec = precision_for(k.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=prec)
    s = jnp.where(valid, s * sm_scale, NEG_INF)
    m_prev = m_ref[rows, :1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # no key yet: avoid inf - inf
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    l_new = l_ref[rows, :1] * alpha + jnp.sum(p, axis=1, keepdims=True)
    v = k if d_v == k.shape[1] else k[:, :d_v]
    pv = jnp.dot(p.astype(k.dtype), v, preferred_element_type=jnp.float32, precision=prec)
    acc_ref[rows, :] = acc_ref[rows, :] * alpha + pv
    m_ref[rows, :] = jnp.broadcast_to(m_new, (m_new.shape[0], m_ref.shape[1]))
    l_ref[rows, :] = jnp.broadcast_to(l_new, (l_new.shape[0], l_ref.shape[1]))


def finalize(acc, m, l, sink, has_keys):
    """(out f32 (M, d_v), max_logits (M, 1), lse (M, 1)) from a row block's state.

    sink (M, 1) f32 (-inf: none); has_keys: bool scalar or (M, 1). Rows without a valid key get
    0 / -inf / +inf; NaN in q or a key row shows as NaN (l keeps it where the max dropped it).
    """
    # NaN test on the bits: jax >= 0.12.1 lowers isnan to a float 'une' compare that libtpu's Mosaic
    # (0.0.52) cannot legalize
    nan_l = (lax.bitcast_convert_type(l, jnp.int32) & 0x7FFFFFFF) > 0x7F800000
    m = jnp.where(nan_l, jnp.nan, m)
    lse = jnp.where(has_keys, m + jnp.log(l), jnp.inf)
    max_logits = jnp.where(has_keys, m, NEG_INF)
    scale = jnp.where(has_keys, 1.0 / (l * (1.0 + jnp.exp(sink - lse))), 0.0)
    return acc * scale, max_logits, lse


def init_state(acc_ref, m_ref, l_ref):
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)


def state_scratch(rows: int, d_v: int = D_V):
    from jax.experimental.pallas import tpu as pltpu

    return [
        pltpu.VMEM((rows, d_v), jnp.float32),
        pltpu.VMEM((rows, 128), jnp.float32),
        pltpu.VMEM((rows, 128), jnp.float32),
    ]


def source_scratch(src: RowSource, bk: int):
    """VMEM buffers (double-buffered) and DMA semaphores for one row source."""
    from jax.experimental.pallas import tpu as pltpu

    bufs = [pltpu.VMEM(src.data_shape(bk), jnp.dtype(src.dtype))]
    if src.fp8:  # each slot's 4-row scale group
        bufs.append(pltpu.VMEM((2, 4 * bk, FP8_ROW), jnp.uint8))
    return bufs, pltpu.SemaphoreType.DMA((2, 2))


def padded_bytes(shape, dtype) -> int:
    """VMEM bytes of an array with tile padding (second-minor to the packing's tile rows, lanes
    to 128)."""
    itemsize = jnp.dtype(dtype).itemsize
    *lead, r, w = shape
    tile_r = 8 * (4 // itemsize)
    n = 1
    for x in lead:
        n *= x
    return n * (-(-r // tile_r) * tile_r) * (-(-w // 128) * 128) * itemsize


def source_vmem_bytes(src: RowSource, bk: int, resident_pages: int = 0) -> int:
    """VMEM of a source's buffers (with `resident_pages` pages of fp8 scale rows)."""
    size = padded_bytes(src.data_shape(bk), src.dtype)
    if src.fp8:
        size += padded_bytes((2, 4 * bk, FP8_ROW), jnp.uint8) + padded_bytes((4, FP8_ROW), jnp.uint8)
        size += padded_bytes((max(resident_pages, 1) * src.scale_groups * 4, FP8_ROW), jnp.uint8)
    return size
