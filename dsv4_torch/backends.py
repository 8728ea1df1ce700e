"""The torch backends, in one table: what each kernel serves, why it cannot run, how it runs.

`ATTENTION` holds the sparse-attention kernels (`dsv4_torch.sparse_attention`, the prefill's
layer call), `CACHE` the fp8_ds_mla cache kernels (`dsv4_torch.kvcache`), `INDEXER` the
Lightning Indexer's top-k (`dsv4_torch.indexer`). `resolve_backend`,
`available_backends`, `run_backend`, the prefill's chunk loop and every "cannot run" error read
these tables, so a backend is added in one place. The JAX twin is `dsv4_jax.backends`.

A request names a backend or says "auto". Errors: an unknown name raises ValueError; a dtype the
named backend does not take raises TypeError; a backend that cannot run on this machine or
device (or has no backward / dropout when the call needs one) raises `BackendUnavailableError`
with the reason. "auto" never changes numerics silently: it picks by device and dtype, in the
order below, and the caller can read which backend ran (`KindMetadata.last_backend`,
`resolve_backend`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4_torch import devices
from planner.contract import BackendUnavailableError, backend_unavailable


def load(path: str) -> Callable:
    """The callable a table entry names as "module:function", imported on first use: the only
    place a name becomes a callable (so `import dsv4_torch` imports no kernel module)."""
    module, fn = path.split(":")
    return getattr(importlib.import_module(module), fn)


@dataclass(frozen=True)
class Backend:
    """One kernel. `unavailable(device)` says why it cannot run on tensors on `device` (None: it
    can); `serves(q)` why it cannot take this q (shape), beyond dtype and device.

    Its callables come resolved, each imported on first use: `kernel` (the table's operation:
    sparse attention, the indexer's top-k), `backward_kernel` (the differentiable form, taking
    dropout; None without a backward), `prefill` (a per-layer call that replaces the chunk loop,
    or None), `op(name)` (a cache backend's "gather" / "insert")."""

    name: str
    summary: str
    dtypes: tuple[torch.dtype, ...]
    device_types: tuple[str, ...]
    unavailable: Callable[[torch.device], str | None]
    function: str = ""  # "module:function" of the kernel
    backward: str = ""  # "module:function" of the differentiable form (with attention dropout); "" = none
    fused_prefill: str = ""  # "module:function" of a per-layer call that replaces the chunk loop
    operations: tuple[tuple[str, str], ...] = ()  # cache backends: (op, "module:function") pairs
    serves: Callable[[torch.Tensor], str | None] = lambda q: None

    @property
    def has_backward(self) -> bool:
        return bool(self.backward)

    @property
    def ops(self) -> tuple[str, ...]:
        """A cache backend's operations ("gather", "insert")."""
        return tuple(op for op, _ in self.operations)

    @functools.cached_property
    def kernel(self) -> Callable:
        return load(self.function)

    @functools.cached_property
    def backward_kernel(self) -> Callable | None:
        return load(self.backward) if self.backward else None

    @functools.cached_property
    def prefill(self) -> Callable | None:
        return load(self.fused_prefill) if self.fused_prefill else None

    def op(self, name: str) -> Callable:
        """A cache backend's callable for operation `name` (KeyError: it has none)."""
        return load(dict(self.operations)[name])


# ----------------------------------------------------------------------------- why not


def _flashmla(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs an SM90/SM100 GPU, the tensors are on {device}"
    from dsv4_torch.kernels.flashmla import attention as flashmla

    return flashmla.unavailable_reason(device)


def _flashmla_serves(q: torch.Tensor) -> str | None:
    from dsv4_torch.kernels.flashmla import attention as flashmla

    if q.ndim != 3 or q.shape[-1] not in flashmla.FLASHMLA_HEAD_DIMS:
        return f"FlashMLA takes head dim D in {flashmla.FLASHMLA_HEAD_DIMS}, q has shape {tuple(q.shape)}"
    return None


def _triton(device: torch.device) -> str | None:
    if (err := devices.triton_import_error()) is not None:
        return err
    if device.type == "cuda":
        return None
    from dsv4_torch.kernels.triton import attention as triton_sparse

    if device.type == "cpu" and triton_sparse.INTERPRETED:
        return triton_sparse.INTERPRETER_UNSUPPORTED
    return (
        f"the tensors are on {device}; the triton backend needs CUDA/ROCm tensors, or CPU tensors with "
        "TRITON_INTERPRET=1 set before dsv4_torch.kernels.triton.attention is first imported"
    )


def _cpu(device: torch.device) -> str | None:
    def built():
        from dsv4_torch.kernels.cpu import library

        return library.unavailable_reason()

    return devices.cpu_unavailable(device, built)


def _triton_cache(device: torch.device) -> str | None:
    if (err := devices.triton_import_error()) is not None:
        return err
    try:
        from dsv4_torch.kernels.triton import kvcache as triton_kvcache
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"cannot import dsv4_torch.kernels.triton.kvcache ({type(e).__name__}: {e})"
    return devices.triton_unavailable(device, interpreted=triton_kvcache.INTERPRETED, module=triton_kvcache.__name__)


_ANY = lambda device: None  # noqa: E731
_BF16, _F16, _F32, _F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64

# ----------------------------------------------------------------------------- the tables

ATTENTION = {
    b.name: b
    for b in (
        Backend(
            "flashmla",
            "the FlashMLA wheel (sgl-flash-mla): SM90/SM100 GPUs, D 512/576",
            (_BF16,),
            ("cuda",),
            _flashmla,
            "dsv4_torch.kernels.flashmla.attention:sparse_attention_flashmla",
            serves=_flashmla_serves,
        ),
        Backend(
            "triton",
            "our Triton kernel: CUDA/ROCm GPUs (CPU tensors under TRITON_INTERPRET=1)",
            (_BF16, _F16, _F32),
            ("cuda", "cpu"),
            _triton,
            "dsv4_torch.kernels.triton.attention:sparse_attention_triton",
        ),
        Backend(
            "cpu",
            "our C/C++ kernel (dsv4_cpu): CPU tensors, on torch's threads",
            (_BF16, _F32),
            ("cpu",),
            _cpu,
            "dsv4_torch.kernels.cpu.attention:sparse_attention_cpu",
            fused_prefill="dsv4_torch.kernels.cpu.prefill:layer",
        ),
        Backend(
            "reference",
            "tiled plain torch: any device, with a backward and dropout",
            (_BF16, _F16, _F32, _F64),
            ("cpu", "cuda"),
            _ANY,
            "dsv4_torch.kernels.reference.attention:sparse_attention_reference",
            backward="dsv4_torch.kernels.reference.attention:sparse_attention_reference_autograd",
        ),
    )
}
# What "auto" tries, per device type, first to last (the Triton interpreter is never picked: tests only).
AUTO = {"cuda": ("flashmla", "triton", "reference"), "cpu": ("cpu", "reference")}

CACHE = {
    b.name: b
    for b in (
        Backend(
            "triton",
            "Triton kernels: CUDA/ROCm (CPU under TRITON_INTERPRET=1)",
            (),
            ("cuda", "cpu"),
            _triton_cache,
            operations=(
                ("gather", "dsv4_torch.kernels.triton.kvcache:gather_dequant"),
                ("insert", "dsv4_torch.kernels.triton.kvcache:quantize_insert"),
                ("gather_rows", "dsv4_torch.kernels.triton.gather:gather_rows"),  # the prefill's rows in q's dtype
            ),
        ),
        Backend(
            "cpu",
            "the C gather (dsv4_cpu): CPU tensors",
            (),
            ("cpu",),
            _cpu,
            operations=(
                ("gather", "dsv4_torch.kernels.cpu.kvcache:gather_dequant"),
                ("gather_mxfp8", "dsv4_torch.kernels.cpu.kvcache_v41:gather"),  # V4.1's 528-byte records
            ),
        ),
        Backend(
            "reference",
            "vectorized torch: any device",
            (),
            ("cpu", "cuda"),
            _ANY,
            operations=(
                ("gather", "dsv4_torch.kernels.reference.kvcache:gather_dequant"),
                ("insert", "dsv4_torch.kernels.reference.kvcache:quantize_insert"),
                # DeepSeek-V4.1's records (dsv4_torch.kvcache_v41): every record, both layouts
                ("insert_records", "dsv4_torch.kernels.reference.kvcache_v41:insert"),
                ("gather_records", "dsv4_torch.kernels.reference.kvcache_v41:gather"),
                ("gather_mxfp8", "dsv4_torch.kernels.reference.kvcache_v41:gather"),
            ),
        ),
    )
}
CACHE_AUTO = {"cuda": ("triton", "reference"), "cpu": ("cpu", "reference")}

_FP8 = torch.float8_e4m3fn
INDEXER = {
    b.name: b
    for b in (
        Backend(
            "cpu",
            "our fused C indexer (dsv4_cpu): CPU tensors, on torch's threads",
            (_BF16, _F32, _FP8),
            ("cpu",),
            _cpu,
            "dsv4_torch.kernels.cpu.indexer:indexer_topk_cpu",
        ),
        Backend(
            "reference",
            "torch ops (float32 logits per request, sorted): any device",
            (_BF16, _F32, _FP8),
            ("cpu", "cuda"),
            _ANY,
            "dsv4_torch.kernels.reference.indexer:indexer_topk_reference",
        ),
    )
}
INDEXER_AUTO = {"cpu": ("cpu", "reference")}

BACKENDS = tuple(ATTENTION)
CACHE_BACKENDS = tuple(CACHE)
INDEXER_BACKENDS = tuple(INDEXER)


def _dtype_names(dtypes) -> str:
    return " / ".join(str(d).replace("torch.", "") for d in dtypes)


def why_not(b: Backend, q: torch.Tensor) -> str | None:
    """Why backend `b` cannot run this q (device, machine, dtype or shape), None when it can."""
    if q.device.type not in b.device_types:  # (auto's order lists each device type's own)
        return b.unavailable(q.device) or f"the {b.name} backend does not take {q.device.type} tensors"
    if (reason := b.unavailable(q.device)) is not None:
        return reason
    if q.dtype not in b.dtypes:
        return f"the {b.name} backend takes {_dtype_names(b.dtypes)}, q is {q.dtype}"
    return b.serves(q)


def resolve_backend(backend: str, q: torch.Tensor, *, needs_grad: bool = False, dropout_p: float = 0.0) -> str:
    """The sparse-attention backend `sparse_attention(q, ..., backend=backend)` runs.

    "auto": on CUDA tensors flashmla (bf16, D 512/576, SM90/SM100, the wheel importable), else
    triton, else reference; on CPU tensors cpu (bf16 / float32, where the C kernel builds), else
    reference (float16, float64). A call that needs a gradient or dropout gets reference (the
    only backend with them). A named backend is returned, or: ValueError (unknown name),
    TypeError (a dtype it does not take), BackendUnavailableError (it cannot run here, or has
    no backward / dropout for a call that needs one), each saying why.
    """
    if not isinstance(backend, str) or (backend != "auto" and backend not in ATTENTION):
        raise ValueError(f"backend: expected one of 'auto', {', '.join(map(repr, ATTENTION))}; got {backend!r}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if needs_grad or dropout_p:
        if backend == "auto" or ATTENTION[backend].has_backward:
            return next(b.name for b in ATTENTION.values() if b.has_backward)
        if needs_grad:
            why = "no backward, and this call needs a gradient (grad mode is on and q, kv or attn_sink requires grad)"
            fix = "run it under torch.no_grad()"
        else:
            why = f"no attention dropout, and this call asks for dropout_p={dropout_p}"
            fix = "use dropout 0 (e.g. model.eval())"
        raise BackendUnavailableError(f"backend={backend!r} has {why}; use backend='reference' (or 'auto'), or {fix}")
    if backend == "auto":
        for name in AUTO.get(q.device.type, ("reference",)):
            if why_not(ATTENTION[name], q) is None:
                return name
        return "reference"
    b = ATTENTION[backend]
    if (reason := b.unavailable(q.device)) is not None:
        raise backend_unavailable(backend, reason)
    if q.dtype not in b.dtypes:
        raise TypeError(f"q: backend={backend!r} takes {_dtype_names(b.dtypes)}, got {q.dtype}")
    if (reason := b.serves(q)) is not None:
        raise backend_unavailable(backend, reason)
    return backend


def resolve_indexer_backend(backend: str, q: torch.Tensor) -> str:
    """The indexer backend `dsv4_torch.indexer.indexer_topk(q, ..., backend=backend)` runs.

    "auto": cpu on CPU tensors where the C library builds, else reference. A named backend is
    returned, or: ValueError (unknown name), TypeError (a q dtype it does not take),
    BackendUnavailableError (it cannot run here), each saying why."""
    if not isinstance(backend, str) or (backend != "auto" and backend not in INDEXER):
        raise ValueError(f"backend: expected one of 'auto', {', '.join(map(repr, INDEXER))}; got {backend!r}")
    if backend == "auto":
        for name in INDEXER_AUTO.get(q.device.type, ("reference",)):
            if why_not(INDEXER[name], q) is None:
                return name
        return "reference"
    b = INDEXER[backend]
    if q.device.type not in b.device_types:
        raise backend_unavailable(backend, f"it takes {' / '.join(b.device_types)} tensors, q is on {q.device}")
    if (reason := b.unavailable(q.device)) is not None:
        raise backend_unavailable(backend, reason)
    if q.dtype not in b.dtypes:
        raise TypeError(f"q: backend={backend!r} takes {_dtype_names(b.dtypes)}, got {q.dtype}")
    return backend


def available_backends() -> dict[str, str | None]:
    """Each sparse-attention backend -> None if it can run on this machine, else the reason.

    Checks the machine (its CUDA device when there is one, else the CPU), not a call: a backend
    may still refuse a dtype or shape (`resolve_backend` says so per call)."""
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    out = {}
    for name, b in ATTENTION.items():
        reasons = [b.unavailable(torch.device(t) if t == "cpu" else cuda) for t in b.device_types if t == "cpu" or cuda]
        out[name] = None if any(r is None for r in reasons) else (reasons[0] if reasons else "no CUDA device")
    return out


def run_backend(name: str, q, kv, indices, sm_scale: float, attn_sink, topk_length, *, grad: bool, dropout_p: float):
    """Run resolved backend `name` on checked arguments (`sparse_attention` after its checks and
    `resolve_backend`; the prefill's chunk loop, which resolves once per layer call). kv (S, D),
    indices (T, K); grad / dropout_p as resolved."""
    b = ATTENTION[name]
    if grad or dropout_p:  # resolve_backend returned a backend with a backward (and dropout)
        seed = _dropout_seed() if dropout_p else 0
        if grad:
            return b.backward_kernel(
                q, kv, indices, sm_scale, attn_sink, topk_length, dropout_p=dropout_p, dropout_seed=seed
            )
        with torch.no_grad():
            return b.kernel(q, kv, indices, sm_scale, attn_sink, topk_length, dropout_p=dropout_p, dropout_seed=seed)
    with torch.no_grad():
        if q.shape[0] == 0 or q.shape[1] == 0:  # never launch a kernel on zero rows
            return _empty_result(q, name)
        return b.kernel(q, kv, indices, sm_scale, attn_sink, topk_length)


def resolve_cache_backend(backend: str, device: torch.device, op: str) -> str:
    """The fp8_ds_mla cache backend a call (`op` "gather" or "insert") on pages on `device` runs.

    "auto": triton on CUDA/ROCm; on the CPU the C kernel for gathers where it builds, else
    reference (the same bits). A named backend that cannot run, or lacks `op`, raises
    BackendUnavailableError saying why."""
    if not isinstance(backend, str) or (backend != "auto" and backend not in CACHE):
        raise ValueError(f"backend: expected one of {('auto',) + CACHE_BACKENDS}, got {backend!r}")
    if backend == "auto":
        for name in CACHE_AUTO.get(device.type, ("reference",)):
            b = CACHE[name]
            if op in b.ops and device.type in b.device_types and b.unavailable(device) is None:
                return name
        return "reference"
    b = CACHE[backend]
    if op not in b.ops:
        if op == "insert":
            why = "it has the gather only (dequantize_and_gather_k_cache); quantize_and_insert_k_cache on CPU tensors runs backend='reference'"
        else:
            why = f"it has no {op!r} (DeepSeek-V4.1 records); backend='reference' runs every record operation"
        raise backend_unavailable(backend, why)
    if (reason := b.unavailable(device)) is not None:
        raise backend_unavailable(backend, reason)
    return backend


def _dropout_seed() -> int:
    # From torch's default CPU generator: a CPU read, never a device sync; torch.manual_seed and
    # torch.utils.checkpoint's RNG-state restore make it reproducible.
    return int(torch.randint(0, 1 << 62, (1,), dtype=torch.int64).item())


def _empty_result(q: torch.Tensor, backend: str):
    from planner.contract import value_dim

    T, H, D = q.shape
    stat = torch.float64 if (q.dtype == torch.float64 and ATTENTION[backend].has_backward) else torch.float32
    return (
        torch.empty((T, H, value_dim(D)), dtype=q.dtype, device=q.device),
        torch.empty((T, H), dtype=stat, device=q.device),
        torch.empty((T, H), dtype=stat, device=q.device),
    )
