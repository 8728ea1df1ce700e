"""The backends the parity suite compares, which of them this machine runs, and how to call them.

Backends (in report order):
  oracle           planner.oracle, float64 NumPy: the reference of every comparison
  torch.reference  dsv4_torch, tiled plain torch (CPU or GPU)
  torch.cpu        dsv4_torch's C kernel (dsv4_cpu) on CPU tensors; its prefill is one fused
                   call per layer, which never sees the plan (so bitwise plan-invariant)
  jax.xla          dsv4_jax, plain jnp (CPU or GPU)
  jax.cpu          dsv4_jax's backend "cpu": the C kernel of dsv4_cpu as XLA FFI calls (CPU)
  torch.triton     dsv4_torch's Triton kernel: a CUDA GPU, else Triton's interpreter on CPU
  jax.triton       dsv4_jax's Pallas-Triton kernel: on an NVIDIA GPU, else in Pallas' interpreter
  jax.mosaic_tpu   dsv4_jax's Pallas TPU kernels (backend "mosaic_tpu"): compiled on a TPU; in TPU
                   interpret mode on CPU only when DSV4_PARITY_TPU_INTERPRET=1 (every simulated DMA
                   is a Python callback: too slow for every case; tests/jax/test_mosaic_tpu.py runs
                   a selection); its prefill never sees the plan (bitwise plan-invariant)
  torch.flashmla   the FlashMLA wheel: SM90/SM100 GPUs, bf16, D in {512, 576}

Inputs are built once as torch tensors and handed to JAX by DLPack (`jax.dlpack.from_dlpack`), so
both frameworks read the very same bits; JAX outputs come back the same way (`torch.from_dlpack`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import torch

import dsv4_jax
import dsv4_torch
import planner as P
from dsv4_jax import prefill as JP
from dsv4_torch import prefill as TP
from planner.sizes import bucket

GPU_ONLY = "needs an SM90/SM100 GPU"
TPU_INTERPRET_SKIP = (
    "no TPU here, and TPU interpret mode is too slow for every parity case (tests/jax/test_mosaic_tpu.py "
    "runs a selection; DSV4_PARITY_TPU_INTERPRET=1 runs them all)"
)
TORCH_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# JAX prefill: small tiles and large minimum buckets, so that the cases of one shape family share
# one compiled program per layer kind (compiling dominates the CPU run time, not attention).
JAX_PREFILL_META = dict(token_tile=16, gather_tile=64, min_tokens=64, min_workspace_rows=1024)


@dataclass(frozen=True)
class Backend:
    name: str
    framework: str  # "numpy", "torch" or "jax"
    dtypes: tuple[str, ...]  # input dtypes it takes
    reference: bool = False  # a reference backend: results must not change by a bit across plans
    head_dims: tuple[int, ...] | None = None  # None: any D


BACKENDS = (
    Backend("oracle", "numpy", ("float64", "float32", "bfloat16")),
    Backend("torch.reference", "torch", ("float64", "float32", "bfloat16"), reference=True),
    Backend("torch.cpu", "torch", ("float32", "bfloat16"), reference=True),
    Backend("jax.xla", "jax", ("float32", "bfloat16"), reference=True),
    Backend("jax.cpu", "jax", ("float32", "bfloat16"), reference=True),  # a token's bits never depend on the plan
    Backend("torch.triton", "torch", ("float32", "bfloat16")),
    Backend("jax.triton", "jax", ("float32", "bfloat16")),
    Backend("jax.mosaic_tpu", "jax", ("float32", "bfloat16"), reference=True),  # plan-free query tiles
    Backend("torch.flashmla", "torch", ("bfloat16",), head_dims=(512, 576)),
)
BY_NAME = {b.name: b for b in BACKENDS}


@dataclass(frozen=True)
class Status:
    """How a backend runs on this machine; `reason` says why not when it cannot."""

    available: bool
    reason: str | None
    mode: str  # what actually runs: "float64 NumPy", "Triton interpreter (CPU)", ...
    kernel: str | None  # the framework's backend name
    interpreted: bool = False  # an interpreter: tiny shapes only

    def as_dict(self) -> dict:
        return dict(
            available=self.available,
            reason=self.reason,
            mode=self.mode,
            kernel=self.kernel,
            interpreted=self.interpreted,
        )


@functools.cache
def machine_status() -> dict[str, Status]:
    """Every backend's status on this machine, from the packages' own `available_backends()`."""
    torch_av = dsv4_torch.available_backends()
    jax_av = dsv4_jax.available_backends()
    jax_platform = jax.devices()[0].platform
    out = {"oracle": Status(True, None, "float64 NumPy", None)}
    out["torch.reference"] = Status(True, None, f"plain torch ({TORCH_DEVICE.type})", "reference")
    if TORCH_DEVICE.type != "cpu":
        out["torch.cpu"] = Status(False, f"the suite's torch tensors are on {TORCH_DEVICE.type}", "-", None)
    elif torch_av["cpu"] is not None:
        out["torch.cpu"] = Status(False, torch_av["cpu"], "-", None)
    else:
        from dsv4_cpu import binding as ckernel

        out["torch.cpu"] = Status(True, None, f"C kernel ({ckernel.best_isa()})", "cpu")
    out["jax.xla"] = Status(True, None, f"plain jnp ({jax_platform})", "xla")
    if jax_av["cpu"] is None:
        out["jax.cpu"] = Status(True, None, "C kernel, XLA FFI (CPU)", "cpu")
    else:
        out["jax.cpu"] = Status(False, jax_av["cpu"], "-", None)
    if torch_av["triton"] is not None:
        out["torch.triton"] = Status(False, torch_av["triton"], "-", None)
    elif TORCH_DEVICE.type == "cuda":
        out["torch.triton"] = Status(True, None, "Triton (GPU)", "triton")
    else:
        out["torch.triton"] = Status(True, None, "Triton interpreter (CPU)", "triton", interpreted=True)
    if jax_av["triton"] is None:
        out["jax.triton"] = Status(True, None, "Pallas -> Triton (GPU)", "triton")
    else:
        out["jax.triton"] = Status(
            True, None, f"Pallas interpret (triton: {jax_av['triton']})", "triton", interpreted=True
        )
    if jax_av["mosaic_tpu"] is None:
        out["jax.mosaic_tpu"] = Status(True, None, "Pallas TPU (compiled)", "mosaic_tpu")
    elif os.environ.get("DSV4_PARITY_TPU_INTERPRET") == "1":
        out["jax.mosaic_tpu"] = Status(True, None, "Pallas TPU interpret mode (CPU)", "mosaic_tpu", interpreted=True)
    else:
        out["jax.mosaic_tpu"] = Status(False, TPU_INTERPRET_SKIP, "-", None)
    reason = torch_av["flashmla"]
    if reason is None:
        out["torch.flashmla"] = Status(True, None, "FlashMLA (GPU)", "flashmla")
    else:
        if not torch.cuda.is_available():
            reason = f"{GPU_ONLY} ({reason})"
        out["torch.flashmla"] = Status(False, reason, "-", None)
    return out


def _tpu(st: Status) -> dict:
    """`interpret=True` for the TPU kernel in TPU interpret mode (an option, not a backend name)."""
    return {"interpret": True} if st.kernel == "mosaic_tpu" and st.interpreted else {}


def why_not(backend: Backend, dtype: str, head_dim: int, tiny: bool) -> str | None:
    """None if `backend` runs a case of this dtype / head dim / size here, else why it does not."""
    st = machine_status()[backend.name]
    if not st.available:
        return st.reason
    if dtype not in backend.dtypes:
        return f"takes {', '.join(backend.dtypes)}, not {dtype}"
    if backend.head_dims is not None and head_dim not in backend.head_dims:
        return f"takes D in {backend.head_dims}, not {head_dim}"
    if st.interpreted and not tiny:
        return "too large for the interpreter on CPU (runs on a GPU)"
    return None


# ----------------------------------------------------------------------------- DLPack crossing


def to_jax(t: torch.Tensor) -> jax.Array:
    """A torch tensor as a jax.Array through DLPack: zero-copy when both sit on the same device.

    A CUDA tensor goes through the host first when JAX has no GPU (still by DLPack)."""
    if t.device.type == "cuda" and jax.devices()[0].platform != "gpu":
        t = t.cpu()
    return jax.dlpack.from_dlpack(t.contiguous())


def to_numpy(x) -> np.ndarray:
    """float64 NumPy copy of a torch tensor or jax.Array (JAX arrays cross back by DLPack)."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    if isinstance(x, jax.Array):
        if x.size == 0:
            return np.zeros(x.shape, np.float64)
        x = torch.from_dlpack(x)
    return x.detach().cpu().double().numpy()


def same_bits(t: torch.Tensor, j: jax.Array) -> bool:
    """True if the torch tensor and the jax.Array hold bit-identical data (NaN payloads included)."""
    a = t.detach().cpu().contiguous()
    b = np.asarray(j)
    if tuple(a.shape) != b.shape:
        return False
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.element_size()]
    a_bits = a.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]).numpy()
    return np.array_equal(a_bits.view(width), b.view(width))


def crossing_probe() -> dict:
    """What DLPack does between torch and JAX here, per dtype: bits kept both ways, memory shared or copied."""
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int32", torch.int32)):
        if dtype.is_floating_point:
            t = torch.linspace(-5, 5, 1024, device=TORCH_DEVICE).to(dtype)
        else:
            t = torch.arange(-512, 512, device=TORCH_DEVICE, dtype=dtype)
        j = to_jax(t)
        back = torch.from_dlpack(j).cpu()
        shared = t.device.type == "cpu" or jax.devices()[0].platform == "gpu"
        out[name] = dict(
            to_jax_bitwise=same_bits(t, j),
            round_trip_bitwise=bool(torch.equal(back.view(torch.uint8), t.cpu().view(torch.uint8))),
            zero_copy=bool(shared and j.unsafe_buffer_pointer() == t.data_ptr()),
        )
    return out


# ----------------------------------------------------------------------------- kernel level


@dataclass
class KernelInputs:
    """`sparse_attention` inputs as torch tensors on TORCH_DEVICE; `jax` holds their DLPack crossings."""

    q: torch.Tensor  # (T, H, D)
    kv: torch.Tensor  # (S, D)
    indices: torch.Tensor  # (T, K) int32
    sm_scale: float
    attn_sink: torch.Tensor | None  # (H,) float32
    topk_length: torch.Tensor | None  # (T,) int32
    jax: dict = field(default_factory=dict)

    def crossed(self) -> dict:
        if not self.jax:
            for name in ("q", "kv", "indices", "attn_sink", "topk_length"):
                t = getattr(self, name)
                self.jax[name] = None if t is None else to_jax(t)
        return self.jax


def run_kernel(name: str, x: KernelInputs):
    """(out, max_logits, lse) of one backend as float64 NumPy arrays."""
    st = machine_status()[name]
    fw = BY_NAME[name].framework
    if fw == "numpy":
        f64 = lambda t: None if t is None else t.detach().cpu().double().numpy()  # noqa: E731
        res = P.oracle.sparse_attention(
            f64(x.q),
            f64(x.kv),
            x.indices.cpu().numpy(),
            x.sm_scale,
            f64(x.attn_sink),
            None if x.topk_length is None else x.topk_length.cpu().numpy(),
        )
        return tuple(np.asarray(r, np.float64) for r in res)
    if fw == "torch":
        res = dsv4_torch.sparse_attention(
            x.q, x.kv, x.indices, x.sm_scale, x.attn_sink, x.topk_length, backend=st.kernel
        )
        return tuple(to_numpy(r) for r in res)
    j = x.crossed()
    res = dsv4_jax.sparse_attention(
        j["q"],
        j["kv"],
        j["indices"],
        x.sm_scale,
        j["attn_sink"],
        j["topk_length"],
        backend=st.kernel,
        interpret=st.interpreted,
    )
    return tuple(to_numpy(r) for r in res)


# ----------------------------------------------------------------------------- prefill level


@dataclass
class Cache:
    """One KV source of a layer in both layouts, as torch tensors (JAX gets DLPack crossings).

    rows (R, D): every request's entries packed (request i at offsets[i]), padded with zeros;
    pages (num_pages, page_size, D) + table (B', max_pages) int32: the same entries in shuffled
    pages, unused slots NaN (a read of one shows up as NaN in the output).
    """

    rows: torch.Tensor
    offsets: torch.Tensor  # (B',) int32, padded past the batch
    lens: list[int]
    pages: torch.Tensor
    table: torch.Tensor
    _jax: dict = field(default_factory=dict)

    def per_request(self) -> list[torch.Tensor]:
        offs = self.offsets.tolist()
        return [self.rows[o : o + n] for o, n in zip(offs, self.lens)]

    def oracle(self) -> list[np.ndarray]:
        return [r.double().cpu().numpy() for r in self.per_request()]

    def torch_source(self, layout: str):
        return TP.PagedKV(self.pages, self.table) if layout == "paged" else self.per_request()

    def jax_source(self, layout: str):
        if layout not in self._jax:
            if layout == "paged":
                self._jax[layout] = JP.PagedKV(to_jax(self.pages), to_jax(self.table))
            else:
                self._jax[layout] = JP.LogicalKV(to_jax(self.rows), to_jax(self.offsets))
        return self._jax[layout]


@dataclass
class LayerInputs:
    """One layer's prefill inputs (torch, TORCH_DEVICE): queries, caches, sink and CSA top-k rows."""

    layer: P.LayerSpec  # the layer's kind and compress ratio
    q: torch.Tensor  # (T, H, D)
    sink: torch.Tensor  # (H,) float32 (float64 for float64 runs)
    topk: torch.Tensor | None  # (T, topk) int32, CSA only
    raw: Cache
    comp: Cache | None
    _jax: dict = field(default_factory=dict)

    def tokens(self, a: int, b: int) -> LayerInputs:
        """The same layer with query tokens a .. b-1 only (a step of a split prompt)."""
        return LayerInputs(
            self.layer, self.q[a:b], self.sink, None if self.topk is None else self.topk[a:b], self.raw, self.comp
        )

    def jax_q(self, padded: int):
        """q and top-k rows crossed to JAX and padded to `padded` tokens. The padding is NaN queries
        and junk top-k ids: padding rows must neither be attended nor leak into outputs."""
        if ("q", padded) not in self._jax:
            q = to_jax(self.q)
            self._jax[("q", padded)] = jnp.pad(q, ((0, padded - q.shape[0]), (0, 0), (0, 0)), constant_values=jnp.nan)
            if self.topk is not None:
                k = to_jax(self.topk)
                self._jax[("topk", padded)] = jnp.pad(k, ((0, padded - k.shape[0]), (0, 0)), constant_values=2**31 - 1)
            self._jax["sink"] = to_jax(self.sink)
        return self._jax[("q", padded)], self._jax.get(("topk", padded)), self._jax["sink"]


def run_prefill(
    name: str,
    step: P.StepPlan,
    layers: dict[P.LayerKind, LayerInputs],
    layout: str,
    topk: int,
    sm_scale: float,
    jax_meta: dict | None = None,
):
    """{kind: (T, H, d_v) float64 output} of one backend for one step (one plan, one cache layout).

    jax_meta: overrides of `JAX_PREFILL_META` (e.g. padded_tokens, to share one program)."""
    st = machine_status()[name]
    fw = BY_NAME[name].framework
    batch = step.batch
    out = {}
    if fw == "numpy":
        for kind, x in layers.items():
            f64 = lambda t: t.detach().cpu().double().numpy()  # noqa: E731
            res, _, _ = P.oracle.prefill_attention(
                f64(x.q),
                x.raw.oracle(),
                None if x.comp is None else x.comp.oracle(),
                batch.seq_lens,
                batch.query_lens,
                kind=kind,
                compress_ratio=x.layer.compress_ratio,
                window_size=step.config.window_size,
                sm_scale=sm_scale,
                attn_sink=f64(x.sink),
                topk_rows=None if x.topk is None else x.topk.cpu().numpy(),
            )
            out[kind] = res
        return out
    if fw == "torch":
        meta = TP.build_step_metadata(step, device=TORCH_DEVICE, index_topk=topk)
        for kind, x in layers.items():
            km = meta[kind]
            if x.q.dtype.is_floating_point:  # rows no chunk writes must never reach an output
                meta.workspace(x.q.shape[2], x.q.dtype).fill_(float("nan"))
            res = TP.prefill_attention(
                x.q,
                km,
                x.raw.torch_source(layout),
                None if x.comp is None else x.comp.torch_source(layout),
                sm_scale=sm_scale,
                attn_sink=x.sink,
                topk_indices=x.topk,
                backend=st.kernel,
            )
            if km.last_backend != st.kernel:
                raise AssertionError(f"{name}: asked for {st.kernel!r}, ran {km.last_backend!r}")
            out[kind] = to_numpy(res)
        return out
    smeta = JP.build_step_metadata(step, index_topk=topk, **{**JAX_PREFILL_META, **(jax_meta or {})})
    T = batch.num_tokens
    for kind, x in layers.items():
        km = smeta[kind]
        q, topk_rows, sink = x.jax_q(smeta.padded_tokens)
        res = JP.prefill_attention(
            q,
            km,
            x.raw.jax_source(layout),
            None if x.comp is None else x.comp.jax_source(layout),
            sm_scale=sm_scale,
            attn_sink=sink,
            topk_indices=topk_rows,
            backend=st.kernel,
            interpret=st.interpreted,
        )
        if km.last_backend != st.kernel:
            raise AssertionError(f"{name}: asked for {st.kernel!r}, ran {km.last_backend!r}")
        full = to_numpy(res)
        if np.any(full[T:]):
            raise AssertionError(f"{name}: padding rows past the {T} tokens are not 0")
        out[kind] = full[:T]
    return out


def padded(n: int, minimum: int) -> int:
    """A bucketed size >= n, so that cases of one family share JAX programs."""
    return bucket(max(n, 1), minimum)
