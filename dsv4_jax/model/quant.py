"""Block-scaled FP8 and FP4 weights on the device, dequantized inside the matmul.

`QuantizedWeight(data, scale, fmt, block)` is a pytree (children `data`, `scale`; `fmt` and
`block` static) holding one linear weight `(..., out, in)` as the official checkpoints ship it:

  fmt "fp8": data float8_e4m3fn (..., out, in); scale (..., cdiv(out, bo), cdiv(in, bi)), block
             (bo, bi) = (128, 128): `w = e4m3 * scale` per block (the last blocks may be partial).
  fmt "fp4": data uint8 (..., out, in/2), two e2m1 values per byte, the low nibble = element 2k,
             the high nibble = 2k+1 (codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; 8..15 the negatives);
             scale (..., out, in/32), block (1, 32).

Scales are either E8M0 exponent bytes (uint8 on the device, `scale = 2^(byte - 127)`, byte 255 =
NaN; the checkpoints' F8_E8M0) or float32 (V4-Flash-Base's FP8 experts). `dequantize(dtype)` is
exact for E8M0 scales in float32 and bfloat16 (e4m3 and e2m1 values times a power of two are
representable in both), so an FP8 model and its dequantized copy compute the same numbers.
`layers.linear` and the MoE call `dense(w, dtype)`, so the dequantized tensor exists only inside
the jitted program, one weight at a time.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.tree_util import register_pytree_node_class

from planner.contract import cdiv

F32 = jnp.float32
FORMATS = ("fp8", "fp4")
FP8_BLOCK = (128, 128)
FP4_BLOCK = (1, 32)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@register_pytree_node_class
class QuantizedWeight:
    """One block-scaled weight (module docstring). `shape` is the logical (..., out, in)."""

    def __init__(self, data, scale, fmt: str, block: tuple[int, int]):
        if fmt not in FORMATS:
            raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
        self.data, self.scale, self.fmt, self.block = data, scale, fmt, tuple(int(b) for b in block)

    def tree_flatten(self):
        return (self.data, self.scale), (self.fmt, self.block)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)  # children may be specs or tracers: no checks here
        obj.data, obj.scale = children
        obj.fmt, obj.block = aux
        return obj

    @property
    def shape(self) -> tuple[int, ...]:
        s = tuple(self.data.shape)
        return s[:-1] + (s[-1] * 2,) if self.fmt == "fp4" else s

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + int(self.scale.nbytes)

    def dequantize(self, dtype=F32):
        return dequantize(self, dtype)

    def __repr__(self):
        return f"QuantizedWeight({self.fmt}, shape={self.shape}, block={self.block}, scale={self.scale.dtype})"


def scale_values(scale):
    """float32 scale factors: E8M0 bytes (uint8) -> 2^(byte - 127) exactly (byte 0 -> 2^-127,
    byte 255 -> NaN); float scales pass through as float32."""
    if scale.dtype != jnp.uint8:
        return scale.astype(F32)
    b = scale.astype(jnp.uint32)
    bits = jnp.where(b == 0, jnp.uint32(0x00400000), jnp.where(b == 255, jnp.uint32(0x7FC00000), b << 23))
    return lax.bitcast_convert_type(bits, F32)


def unpack_e2m1(packed):
    """uint8 (..., k) of two e2m1 codes per byte -> float32 (..., 2k); low nibble first."""
    p = packed.astype(jnp.uint8)
    codes = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    e = ((codes >> 1) & 3).astype(jnp.int32)
    m = (codes & 1).astype(F32)
    # e = 0: subnormal 0.5 * m; else (1 + m / 2) * 2^(e - 1)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (jnp.left_shift(1, e).astype(F32) * 0.5))
    return jnp.where((codes & 8) != 0, -mag, mag)


def dequantize(w: QuantizedWeight, dtype=F32):
    """The weight (..., out, in) in `dtype`: values times their block's scale, in float32."""
    vals = unpack_e2m1(w.data) if w.fmt == "fp4" else w.data.astype(F32)
    out, inp = vals.shape[-2:]
    bo, bi = w.block
    s = scale_values(w.scale)
    s = jnp.repeat(jnp.repeat(s, bo, axis=-2), bi, axis=-1)[..., :out, :inp]
    return (vals * s).astype(dtype)


def dense(w, dtype):
    """A weight as a plain array of `dtype`: dequantized if quantized, else cast."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w, dtype)
    return w.astype(dtype)


# ----------------------------------------------------------------------------- host side (NumPy)


def expected_scale_shape(fmt: str, shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a logical weight shape (..., out, in)."""
    *lead, out, inp = shape
    return (*lead, cdiv(out, block[0]), cdiv(inp, block[1]))


def scale_values_np(scale: np.ndarray) -> np.ndarray:
    if scale.dtype == np.uint8:
        scale = scale.view(ml_dtypes.float8_e8m0fnu)
    return scale.astype(np.float32)


def unpack_e2m1_np(packed: np.ndarray) -> np.ndarray:
    p = packed.view(np.uint8)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    table = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), np.float32)
    return table[codes]


def dequantize_np(data: np.ndarray, scale: np.ndarray, fmt: str, block: tuple[int, int]) -> np.ndarray:
    """NumPy float32 twin of `dequantize` (for checks and the fixture writer)."""
    vals = unpack_e2m1_np(data) if fmt == "fp4" else data.astype(np.float32)
    out, inp = vals.shape[-2:]
    s = scale_values_np(scale)
    s = np.repeat(np.repeat(s, block[0], axis=-2), block[1], axis=-1)[..., :out, :inp]
    return vals * s


def device_scale(scale: np.ndarray) -> np.ndarray:
    """A checkpoint scale as the device holds it: E8M0 -> its uint8 exponent bytes; float32 as is."""
    if scale.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        return scale.view(np.uint8)
    return scale
