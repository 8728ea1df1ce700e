"""The plan behind vLLM's `DeepseekSparseSWAMetadata.get_prefill_chunk_plan`, from our planner.

vLLM 0.33.0 calls `swa_metadata.get_prefill_chunk_plan(compress_ratio, prefill_chunk_size,
has_compressed=None)` inside every attention layer's `_forward_prefill`. This replacement plans
once per step per `(compress_ratio, prefill_chunk_size, has_compressed)` and keeps the plans on
the step's metadata object (vLLM builds a fresh one every step), so a 43-layer V4-Flash step plans
each of its three kinds once and answers the other calls from that cache.

The plan is `planner.plan_kind`'s adaptive plan in vLLM's tuple form `(start, end, N, M)` (for
steps of up to `SMALL_STEP` prefill requests the same tuples from `planner.plan.vllm_chunk_tuples`,
which plans on Python lists: NumPy's fixed cost per call would be most of a small step's time),
identical to vLLM's own wherever every prefill request has query tokens. Requests with
`query_len == 0` (KV-transfer loads, padded rows) never form or widen a chunk, and no chunk's
range `[start, end)` contains one (`PlanConfig(contiguous=True)`): vLLM's chunk loop gathers every
request of the range into workspace slot `request - start`, so a skipped request inside a range
would still be gathered. A step whose prefill requests all have zero queries gets `[]`.

DeepSeek-V4.1's bounded replay (vLLM's `DeepseekV41ModelState._prepare_replay_batch`) builds two
more metadata objects a step for the kept rows (each prefill's last min(query_len, W) rows, the
planner's `PrefillBatch.band("replay")`): one for the cut layer (the batch's window floors) and one
for the layers past it (`kept_kv_start`). vLLM's plan reads neither floor, so both ask for the same
`(seq_lens, kept query_lens)` plan. Steps are therefore shared by content, not only by object:
a metadata object whose prefill lengths and limits equal those of a recently planned one (the
last few, `_RECENT`) reads that step's plans, so the kept rows are planned once a step for every
layer from the cut on. The plan is a function of exactly those inputs, so sharing cannot change
a result.

Nothing here imports vLLM: it reads the metadata object's attributes only.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

import planner
from planner.plan import vllm_chunk_tuples

_CACHE_ATTR = "_dsv4_prefill_step_plans"


@lru_cache(maxsize=64)
def _config(window_size: int, max_model_len: int, max_num_batched_tokens: int, prefill_chunk_size: int):
    return planner.PlanConfig(
        window_size=window_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_size=prefill_chunk_size,
        contiguous=True,
    )


@lru_cache(maxsize=64)
def _layer(compress_ratio: int, has_compressed: bool):
    """The layer spec to plan: vLLM's rows depend on the ratio and on whether a compressed cache is
    gathered, not on which compressed kind (CSA and HCA layers of one ratio plan the same chunks),
    so a compressed layer is planned as HCA at its ratio, a window-only one as SWA."""
    if has_compressed:
        return planner.LayerSpec(planner.LayerKind.HCA, compress_ratio)
    return planner.LayerSpec(planner.LayerKind.SWA, 0)


# Steps of up to this many prefill requests are planned on Python lists
# (`planner.plan.vllm_chunk_tuples`), larger ones on NumPy (`planner.plan_kind`): the same tuples.
SMALL_STEP = 64


def _host_ints(t, name: str, n: int) -> np.ndarray:
    """The first n entries of a CPU integer tensor (or array) as NumPy, without a copy."""
    if t is None:
        raise ValueError(f"{name}: None on a step with {n} prefill requests")
    try:
        a = t.numpy() if hasattr(t, "numpy") else np.asarray(t)
    except TypeError as e:  # a tensor on a device: reading it would wait for the device
        raise ValueError(f"{name}: expected a CPU tensor ({e})") from None
    if a.ndim != 1 or a.shape[0] < n:
        raise ValueError(f"{name}: expected at least {n} entries (num_prefills), got shape {tuple(a.shape)}")
    return a[:n]


def _host_list(t, name: str, n: int) -> list:
    """The first n entries of a CPU tensor (or array) as a list, in one `tolist()`."""
    if t is None:
        raise ValueError(f"{name}: None on a step with {n} prefill requests")
    if getattr(t, "is_cpu", True) is False:  # reading it would wait for the device
        raise ValueError(f"{name}: expected a CPU tensor, got one on {t.device}")
    if getattr(t, "ndim", None) != 1 or len(t) < n:
        raise ValueError(f"{name}: expected at least {n} entries (num_prefills), got shape {tuple(np.shape(t))}")
    return (t[:n] if len(t) != n else t).tolist()


class StepPlans:
    """One step's prefill lengths and the plans made from them so far, keyed by planning inputs.

    Shared by every metadata object of the step with the same prefill lengths and limits (the
    replay batch's two objects), each bound to it by a `_Binding`. Up to `SMALL_STEP` requests
    the lengths stay Python lists, planned by `planner.plan.vllm_chunk_tuples`; more become a
    `planner.PrefillBatch` planned by `planner.plan_kind` (both check them alike)."""

    __slots__ = ("limits", "batch", "lists", "plans", "planned")

    def __init__(self, limits, seq, qry):
        n, W, mml, mnbt = limits
        self.limits = limits
        if isinstance(seq, list):
            self.batch, self.lists = None, (seq, qry)
        else:
            self.batch, self.lists = planner.PrefillBatch(seq, qry, mml, mnbt), None  # copies the lengths
        self.plans: dict[tuple, list[tuple[int, int, int, int]]] = {}
        self.planned = 0  # how many plans this step made (one per key)

    def plan(self, compress_ratio: int, prefill_chunk_size: int, has_compressed: bool):
        _, W, mml, mnbt = self.limits
        config = _config(W, mml, mnbt, prefill_chunk_size)
        layer = _layer(compress_ratio, has_compressed)
        if self.batch is None:
            plan = vllm_chunk_tuples(*self.lists, config, layer)
        else:
            plan = planner.plan_kind(self.batch, config, layer).as_tuples()
        self.planned += 1
        return plan


class _Binding:
    """A metadata object's link to its step: the length tensors it was read from (a reassigned
    field unbinds it) and the step's shared plans."""

    __slots__ = ("seq_lens_cpu", "query_lens_cpu", "limits", "plans", "step")

    def __init__(self, md, limits, step: StepPlans):
        self.seq_lens_cpu = md.prefill_seq_lens_cpu
        self.query_lens_cpu = md.prefill_query_lens_cpu
        self.limits = limits
        self.step = step
        self.plans = step.plans

    def describes(self, md) -> bool:
        """Whether `md` still holds the inputs this binding was made from (fields reassigned: no)."""
        return (
            md.prefill_seq_lens_cpu is self.seq_lens_cpu
            and md.prefill_query_lens_cpu is self.query_lens_cpu
            and self.limits == _limits(md)
        )


# Recently planned steps by content: (limits, seq_lens, query_lens as tuples or bytes) -> StepPlans.
# A step has at most three metadata objects (the batch, the replay batch's two); a few more
# entries cover engines that build metadata for micro-batches too.
_RECENT: dict[tuple, StepPlans] = {}
_RECENT_MAX = 8
_RECENT_LOCK = threading.Lock()


def _limits(md) -> tuple[int, int, int, int]:
    return (md.num_prefills, md.prefill_window_size, md.prefill_max_model_len, md.prefill_max_num_batched_tokens)


def _bind(md) -> _Binding:
    """Bind `md` to the step its prefill lengths describe: a recent one with equal content, else a new one."""
    limits = _limits(md)
    n = limits[0]
    if n <= SMALL_STEP:
        seq = _host_list(md.prefill_seq_lens_cpu, "prefill_seq_lens_cpu", n)
        qry = _host_list(md.prefill_query_lens_cpu, "prefill_query_lens_cpu", n)
        key = (limits, tuple(seq), tuple(qry))
    else:
        seq = _host_ints(md.prefill_seq_lens_cpu, "prefill_seq_lens_cpu", n)
        qry = _host_ints(md.prefill_query_lens_cpu, "prefill_query_lens_cpu", n)
        key = (limits, seq.dtype.str, seq.tobytes(), qry.dtype.str, qry.tobytes())
    with _RECENT_LOCK:  # (metadata may be built beside a running forward)
        step = _RECENT.get(key)
        if step is None:
            step = StepPlans(limits, seq, qry)
            if len(_RECENT) >= _RECENT_MAX:
                del _RECENT[next(iter(_RECENT))]  # the oldest
            _RECENT[key] = step
    binding = _Binding(md, limits, step)
    md.__dict__[_CACHE_ATTR] = binding
    return binding


def forget_steps() -> None:
    """Drop the recently planned steps (`_RECENT`): the next metadata object plans afresh."""
    with _RECENT_LOCK:
        _RECENT.clear()


def step_plans(md) -> StepPlans | None:
    """The step whose plans answer `md` (None before the first call); shared by equal metadata."""
    binding = md.__dict__.get(_CACHE_ATTR)
    return None if binding is None else binding.step


def get_prefill_chunk_plan(self, compress_ratio: int, prefill_chunk_size: int, has_compressed: bool | None = None):
    """vLLM's `(start, end, N, M)` chunk plan of this step's prefill requests, planned once.

    Installed as `DeepseekSparseSWAMetadata.get_prefill_chunk_plan` by the plugin. Same
    arguments and result type as vLLM 0.33.0's method: `has_compressed=None` means
    `compress_ratio > 1` (V4.0's layers); V4.1 passes it explicitly (its ratio-1 layers gather a
    full-length compressed cache). The returned list is shared by every layer of the step that
    asks with the same arguments; callers only iterate it.
    """
    # Every layer after the first of its kind lands here: a dict lookup, nothing more.
    bound = self.__dict__.get(_CACHE_ATTR)
    if (
        bound is not None
        and bound.seq_lens_cpu is self.prefill_seq_lens_cpu
        and bound.query_lens_cpu is self.prefill_query_lens_cpu
    ):
        plan = bound.plans.get((compress_ratio, prefill_chunk_size, has_compressed))
        if plan is not None:
            return plan
    return _plan_first(self, compress_ratio, prefill_chunk_size, has_compressed)


def _plan_first(md, compress_ratio, prefill_chunk_size, has_compressed):
    """The first call of a step with these arguments: check them, plan (or reuse an equal key)."""
    if md.num_prefills == 0:
        return []
    hc = planner.contract.has_compressed(compress_ratio, has_compressed)  # vLLM 0.33's rule, checked
    if isinstance(prefill_chunk_size, bool) or not isinstance(prefill_chunk_size, (int, np.integer)):
        raise ValueError(f"prefill_chunk_size: expected an integer, got {prefill_chunk_size!r}")
    key = (int(compress_ratio), int(prefill_chunk_size), hc)
    bound = md.__dict__.get(_CACHE_ATTR)
    if bound is None or not bound.describes(md):
        bound = _bind(md)
    step = bound.step
    plan = step.plans.get(key)
    if plan is None:  # (4, 4, None) and (4, 4, True) are one plan
        plan = step.plans[key] = step.plan(*key)
    step.plans[(compress_ratio, prefill_chunk_size, has_compressed)] = plan
    return plan
