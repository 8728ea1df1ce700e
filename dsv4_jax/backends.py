"""The JAX backends, in one table: what each kernel serves, why it cannot run, how it runs.

`ATTENTION` holds the sparse-attention kernels (`dsv4_jax.sparse_attention`, the prefill's layer
call), `CACHE` the fp8_ds_mla cache kernels (`dsv4_jax.kvcache`), `INDEXER` the Lightning
Indexer's top-k (`dsv4_jax.indexer`). `resolve_backend`,
`available_backends`, `run_backend`, the prefill (which resolves once per layer call) and every
"cannot run" error read these tables. The torch twin is `dsv4_torch.backends`.

One name per kernel, as JAX names Pallas' backends: "triton" (a Pallas kernel lowered through
Triton, NVIDIA GPUs), "mosaic_gpu" (a Pallas Mosaic GPU kernel, Hopper), "mosaic_tpu" (Pallas TPU
kernels), plus "cpu" (our C kernel as XLA FFI calls) and "xla" (plain jnp). A Pallas kernel also runs in its interpreter on
any platform: that is the option `interpret=True` (or interpret parameters), never a backend
name of its own. Names used before (pallas, pallas_triton, pallas_interpret, mosaic,
mosaic_interpret) raise a ValueError naming their replacement.

Where a call runs: the devices of its committed input arrays, else JAX's default device (where a
jitted call on traced arrays runs). Errors: an unknown name, or an input shape a kernel does not
take, raises ValueError; a dtype it does not take, TypeError; a kernel that cannot run on those
devices (or without an interpret mode, asked for one) `BackendUnavailableError` saying why.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp

from dsv4_jax import devices
from planner.contract import backend_unavailable


def load(path: str) -> Callable:
    """The callable a table entry names as "module:function", imported on first use: the only
    place a name becomes a callable (so `import dsv4_jax` imports no kernel module)."""
    module, fn = path.split(":")
    return getattr(importlib.import_module(module), fn)


@dataclass(frozen=True)
class Backend:
    """One kernel. `unavailable(arrays)` says why its compiled form cannot run on the arrays'
    devices (None: it can); `interpret_unavailable()` why its interpret mode cannot run here
    (only for kernels with one); `serves(q)` why it cannot take q's shape (beyond its dtypes).

    Its callables come resolved, each imported on first use: `kernel` (the table's operation:
    sparse attention `(q, kv, indices, sm_scale, sink, topk_length[, interpret=])`, the indexer's
    top-k), `prefill` (a per-layer call that replaces the chunk loop, or None), `op(name)` (a
    cache backend's "gather" / "insert"; with `interpret=` where the backend has an interpret
    mode). `has_backward`: whether `jax.grad` goes through it (xla: JAX's autodiff of plain jnp;
    the cpu backend's FFI calls raise NotImplementedError, the Pallas kernels have no derivative
    rule)."""

    name: str
    summary: str
    dtypes: tuple
    unavailable: Callable[[tuple], str | None]
    function: str = ""  # "module:function" of the kernel
    backward: bool = False  # jax.grad goes through it
    interpret: bool = False  # has an interpret mode (any platform)
    interpret_unavailable: Callable[[], str | None] = lambda: None
    serves: Callable[[object], str | None] = lambda q: None
    fused_prefill: str = ""  # "module:function" of a per-layer call that replaces the chunk loop
    # static keyword arguments of the fused layer call for an `interpret` value (e.g. the TPU
    # kernel's interpret parameters and the block shapes of the chip it compiles for)
    prefill_options: Callable[[object], tuple] = lambda interpret: ()
    operations: tuple[tuple[str, str], ...] = ()  # cache backends: (op, "module:function") pairs

    @property
    def has_backward(self) -> bool:
        return self.backward

    @property
    def ops(self) -> tuple[str, ...]:
        """A cache backend's operations ("gather", "insert")."""
        return tuple(op for op, _ in self.operations)

    @functools.cached_property
    def kernel(self) -> Callable:
        return load(self.function)

    @functools.cached_property
    def prefill(self) -> Callable | None:
        return load(self.fused_prefill) if self.fused_prefill else None

    def op(self, name: str) -> Callable:
        """A cache backend's callable for operation `name` (KeyError: it has none)."""
        return load(dict(self.operations)[name])


_BF16, _F16, _F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)

# ----------------------------------------------------------------------------- why not


def _triton(arrays) -> str | None:
    return devices.triton_unavailable(arrays)


def _cpu(arrays) -> str | None:
    platforms = sorted({d.platform for d in devices.devices_for(arrays)})
    if platforms != ["cpu"]:
        return f"runs on CPU arrays, but the arrays are on {platforms or 'no device'}"
    from dsv4_jax.kernels.cpu import library as cpu

    return cpu.unavailable_reason()


def _mosaic_gpu(arrays) -> str | None:
    from dsv4_jax.kernels.mosaic_gpu import attention as mosaic

    if (reason := mosaic.unavailable_reason()) is not None:
        return reason
    for device in devices.devices_for(arrays):
        if (reason := devices.nvidia_gpu_unavailable(device)) is not None:
            return reason
        capability = getattr(device, "compute_capability", None)
        if capability is not None and str(capability) != "9.0":
            return f"is a Hopper (SM90, wgmma) kernel, got compute capability {capability} on {device.device_kind}"
    return None


def _mosaic_gpu_interpret() -> str | None:
    from dsv4_jax.kernels.mosaic_gpu import attention as mosaic

    return mosaic.unavailable_reason()


def _mosaic_gpu_serves(q) -> str | None:
    from dsv4_jax.kernels.mosaic_gpu import attention as mosaic

    shape = tuple(getattr(q, "shape", ()))
    if len(shape) != 3:
        return f"serves q of shape (T, H, D), got {shape}"
    if shape[1] not in mosaic.HEADS:
        return f"serves {mosaic.HEADS} heads, got H={shape[1]}"
    if shape[2] not in mosaic.HEAD_DIMS:
        return f"serves head dims {mosaic.HEAD_DIMS}, got D={shape[2]}"
    return None


def _mosaic_tpu(arrays) -> str | None:
    from dsv4_jax.kernels.mosaic_tpu import attention as mosaic_tpu

    if mosaic_tpu.compile_target_chip() is not None:  # compiling for a chosen TPU from this machine
        return mosaic_tpu.unavailable_reason()
    platforms = sorted({d.platform for d in devices.devices_for(arrays)})
    if platforms != ["tpu"]:
        return (
            f"compiles for TPU arrays, but the arrays are on {', '.join(platforms) or 'no device'}; pass "
            "interpret=True to run it in TPU interpret mode, or compile for a chip inside "
            "dsv4_jax.kernels.mosaic_tpu.attention.compile_target"
        )
    return mosaic_tpu.unavailable_reason()


def _mosaic_tpu_interpret() -> str | None:
    from dsv4_jax.kernels.mosaic_tpu import attention as mosaic_tpu

    return mosaic_tpu.unavailable_reason()


def _mosaic_tpu_options(interpret) -> tuple:
    from dsv4_jax.kernels.mosaic_tpu import attention as mosaic_tpu

    params = mosaic_tpu.interpret_params(interpret)
    chip = None if params is not None else mosaic_tpu.target_chip()
    return (("interpret", params), ("shapes", mosaic_tpu.block_shapes(chip)))


_ANY = lambda arrays: None  # noqa: E731

# ----------------------------------------------------------------------------- the tables

ATTENTION = {
    b.name: b
    for b in (
        Backend(
            "xla",
            "the plain-jnp reference: any platform, fp32 math, tiled, deterministic",
            (_BF16, _F16, _F32),
            _ANY,
            "dsv4_jax.kernels.xla.attention:sparse_attention_xla",
            backward=True,
        ),
        Backend(
            "cpu",
            "our C kernel (dsv4_cpu) as XLA FFI calls on XLA's threads: CPU arrays, no backward",
            (_BF16, _F32),
            _cpu,
            "dsv4_jax.kernels.cpu.attention:sparse_attention",
            fused_prefill="dsv4_jax.kernels.cpu.prefill:layer",
        ),
        Backend(
            "triton",
            "a Pallas kernel lowered through Triton: NVIDIA GPUs of compute capability >= 8.0",
            (_BF16, _F16, _F32),
            _triton,
            "dsv4_jax.kernels.triton.attention:sparse_attention_pallas",
            interpret=True,
        ),
        Backend(
            "mosaic_gpu",
            "a Pallas Mosaic GPU kernel: Hopper (SM90) GPUs, jax >= 0.12, bf16, H 16-128, D 512/576",
            (_BF16,),
            _mosaic_gpu,
            "dsv4_jax.kernels.mosaic_gpu.attention:sparse_attention_mosaic",
            interpret=True,
            interpret_unavailable=_mosaic_gpu_interpret,
            serves=_mosaic_gpu_serves,
        ),
        Backend(
            "mosaic_tpu",
            "Pallas TPU kernels (flat contract; the prefill per query tile from the caches): TPUs, bf16 / float32",
            (_BF16, _F32),
            _mosaic_tpu,
            "dsv4_jax.kernels.mosaic_tpu.attention:sparse_attention_mosaic_tpu",
            interpret=True,
            interpret_unavailable=_mosaic_tpu_interpret,
            fused_prefill="dsv4_jax.kernels.mosaic_tpu.prefill:layer",
            prefill_options=_mosaic_tpu_options,
        ),
    )
}
# What "auto" tries, per platform, first to last (interpret modes are never picked: tests only).
AUTO = {"gpu": ("mosaic_gpu", "triton", "xla"), "cpu": ("cpu", "xla"), "tpu": ("mosaic_tpu", "xla")}

CACHE = {
    b.name: b
    for b in (
        Backend(
            "xla",
            "plain jnp / lax: any platform",
            (),
            _ANY,
            operations=(
                ("gather", "dsv4_jax.kernels.xla.kvcache:gather_dequant"),
                ("insert", "dsv4_jax.kernels.xla.kvcache:quantize_insert"),
                # DeepSeek-V4.1's records (dsv4_jax.kvcache_v41): every record, both layouts
                ("insert_records", "dsv4_jax.kernels.xla.kvcache_v41:insert"),
                ("gather_records", "dsv4_jax.kernels.xla.kvcache_v41:gather"),
                ("gather_mxfp8", "dsv4_jax.kernels.xla.kvcache_v41:gather"),
            ),
        ),
        Backend(
            "triton",
            "Pallas kernels lowered through Triton: NVIDIA GPUs",
            (),
            _triton,
            interpret=True,
            operations=(
                ("gather", "dsv4_jax.kernels.triton.kvcache:gather_dequant"),
                ("insert", "dsv4_jax.kernels.triton.kvcache:quantize_insert"),
            ),
        ),
        Backend(
            "cpu",
            "the C gather (dsv4_cpu) as an XLA FFI call: CPU arrays",
            (),
            _cpu,
            operations=(
                ("gather", "dsv4_jax.kernels.cpu.kvcache:gather_dequant"),
                ("gather_segments", "dsv4_jax.kernels.cpu.kvcache:gather_segments"),  # the prefill's workspace regions
                ("gather_mxfp8", "dsv4_jax.kernels.cpu.kvcache_v41:gather"),  # V4.1's 528-byte records
            ),
        ),
    )
}
CACHE_AUTO = {"gpu": ("triton", "xla"), "cpu": ("cpu", "xla")}

_F8 = jnp.dtype(jnp.float8_e4m3fn)
INDEXER = {
    b.name: b
    for b in (
        Backend(
            "xla",
            "plain jnp / lax: any platform",
            (_BF16, _F32, _F8),
            _ANY,
            "dsv4_jax.kernels.xla.indexer:indexer_topk_xla",
        ),
        Backend(
            "cpu",
            "our fused C indexer (dsv4_cpu) as an XLA FFI call: CPU arrays",
            (_BF16, _F32, _F8),
            _cpu,
            "dsv4_jax.kernels.cpu.indexer:indexer_topk_cpu",
        ),
    )
}
INDEXER_AUTO = {"gpu": ("xla",), "cpu": ("cpu", "xla")}

BACKENDS = tuple(ATTENTION)
CACHE_BACKENDS = tuple(CACHE)
INDEXER_BACKENDS = tuple(INDEXER)

# Backend names used before one name per kernel; each raises pointing to its replacement.
RENAMED = {
    "pallas": "backend='triton' (add interpret=True where there is no NVIDIA GPU)",
    "pallas_triton": "backend='triton'",
    "pallas_interpret": "backend='triton', interpret=True",
    "mosaic": "backend='mosaic_gpu' (add interpret=True where there is no Hopper GPU)",
    "mosaic_interpret": "backend='mosaic_gpu', interpret=True",
}


def check_name(backend, table: dict, what: str = "backend") -> None:
    """Raise ValueError for a name that is not "auto" or one of `table`'s (pointing renamed ones
    to their replacement)."""
    if isinstance(backend, str) and backend in RENAMED:
        raise ValueError(f"{what}={backend!r} was renamed: use {RENAMED[backend]}")
    if not isinstance(backend, str) or (backend != "auto" and backend not in table):
        raise ValueError(f"{what}: expected one of 'auto', {', '.join(map(repr, table))}; got {backend!r}")


def _platform(arrays) -> str:
    found = devices.devices_for(arrays)
    return found[0].platform if found else "cpu"


def _resolve(table: dict, auto: dict, backend: str, arrays, interpret, q=None, op: str | None = None) -> str:
    check_name(backend, table)
    if backend == "auto":
        if interpret:
            raise ValueError("interpret: a request with interpret=True must name its backend (auto never interprets)")
        for name in auto.get(_platform(arrays), ("xla",)):
            b = table[name]
            if op is not None and op not in b.ops:
                continue
            if q is not None and (jnp.dtype(q.dtype) not in b.dtypes or b.serves(q) is not None):
                continue
            if b.unavailable(arrays) is None:
                return name
        return "xla"
    b = table[backend]
    if op is not None and op not in b.ops:
        if op == "insert":
            why = "it has the gather only (dequantize_and_gather_k_cache); quantize_and_insert_k_cache on CPU runs backend='xla'"
        else:
            why = f"it has no {op!r} (DeepSeek-V4.1 records); backend='xla' runs every record operation"
        raise backend_unavailable(backend, why)
    if interpret:
        if not b.interpret:
            raise backend_unavailable(backend, "it has no interpret mode (interpret=True is for the Pallas kernels)")
        reason = b.interpret_unavailable()
    else:
        reason = b.unavailable(arrays)
    if reason is not None:
        hint = "; interpret=True runs it in its interpreter" if b.interpret and not interpret else ""
        raise backend_unavailable(backend, reason + hint)
    if q is not None and b.dtypes and jnp.dtype(q.dtype) not in b.dtypes:
        names = " / ".join(d.name for d in b.dtypes)
        raise TypeError(f"q: backend={backend!r} takes {names}, got {jnp.dtype(q.dtype)}")
    if q is not None and (reason := b.serves(q)) is not None:
        raise ValueError(f"q: backend={backend!r} {reason}")
    return backend


def resolve_backend(backend: str = "auto", *arrays, interpret=False) -> str:
    """The sparse-attention backend a request runs (a key of `ATTENTION`).

    "auto": on an NVIDIA GPU mosaic_gpu (SM90, jax >= 0.12, for the dtype and shapes it takes),
    else triton; on the CPU cpu for bf16 / float32 q (or no q) where the C kernel builds; else
    xla (float16 on the CPU among them). When the first array is q its dtype and shape count.
    A named backend is returned or the error says why not (module doc); `interpret` (True or
    interpret parameters) runs a Pallas kernel in its interpreter, on any platform.
    """
    q = arrays[0] if arrays and getattr(arrays[0], "dtype", None) is not None else None
    return _resolve(ATTENTION, AUTO, backend, arrays, interpret, q=q)


def resolve_cache_backend(backend: str = "auto", *arrays, op: str = "gather", interpret=False) -> str:
    """The fp8_ds_mla cache backend (a key of `CACHE`) a call (`op` "gather" or "insert") on
    `arrays` runs: "auto" = triton on NVIDIA GPUs; on the CPU the C kernel for gathers where it
    builds, else xla (the same bits)."""
    ops = ("gather", "insert", "insert_records", "gather_records", "gather_mxfp8")  # the last three: V4.1 records
    if op not in ops:
        raise ValueError(f"op: expected one of {ops}, got {op!r}")
    return _resolve(CACHE, CACHE_AUTO, backend, arrays, interpret, op=op)


def resolve_indexer_backend(backend: str = "auto", *arrays) -> str:
    """The indexer backend (a key of `INDEXER`) `dsv4_jax.indexer.indexer_topk` runs on `arrays`
    (q first): "auto" = cpu on CPU arrays where the C library builds, else xla."""
    q = arrays[0] if arrays and getattr(arrays[0], "dtype", None) is not None else None
    return _resolve(INDEXER, INDEXER_AUTO, backend, arrays, False, q=q)


def available_backends(*arrays) -> dict[str, str | None]:
    """Each sparse-attention backend -> None if its compiled form can run here (on `arrays`'
    devices when given and committed, else the default device), else the reason. (A backend
    may still refuse a dtype or shape: `resolve_backend` checks those per call.)"""
    return {name: b.unavailable(arrays) for name, b in ATTENTION.items()}


def run_backend(name: str, q, kv, indices, sm_scale: float, attn_sink=None, topk_length=None, *, interpret=False):
    """Run resolved backend `name` on checked, canonical arguments (`sparse_attention` after its
    checks; the prefill's tiles, resolved once per layer call)."""
    b = ATTENTION[name]
    kw = {"interpret": interpret} if b.interpret else {}
    return b.kernel(q, kv, indices, sm_scale, attn_sink, topk_length, **kw)
