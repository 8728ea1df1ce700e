"""Run parity cases on every backend this machine has and compare every pair.

`run_kernel_cases(cases)` and `run_step_case(case)` return `Row`s: one per report row (case
class, layer kind, dtype), holding one `Agreement` per backend pair (the worst over the row's
cases, plans and cache layouts), the backends that did not run and why, and for prefill rows the
plan invariance of each backend (bitwise for the reference backends). Both pytest and the report
command go through here.
"""

from __future__ import annotations

import itertools
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

import planner as P
from tests.parity import backends as B
from tests.parity.cases import PRIMARY, KernelCase, StepCase
from tests.parity.tolerances import Agreement, combine, compare_out, compare_stat


@dataclass
class Row:
    """One report row: every backend pair's agreement over the row's cases."""

    level: str  # "kernel", "prefill" or "hf"
    name: str
    cases: list[str] = field(default_factory=list)
    pairs: dict = field(default_factory=dict)  # (a, b) -> list[(out Agreement, [stat Agreements])]
    invariance: dict = field(default_factory=dict)  # backend -> list[Agreement] (variant vs primary)
    bitwise_required: set = field(default_factory=set)  # backends whose invariance must be bitwise
    not_run: dict = field(default_factory=dict)  # backend -> set of reasons
    ran: set = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    crossings: int = 0  # tensors checked bitwise equal after crossing to JAX by DLPack
    seconds: float = 0.0
    backend_seconds: dict = field(default_factory=dict)  # wall time per backend (compiles included)

    def cell(self, a: str, b: str) -> Agreement | None:
        parts = self.pairs.get((a, b))
        if not parts:
            return None
        return combine([p[0] for p in parts], [s for p in parts for s in p[1]])

    def invariant(self, backend: str) -> Agreement | None:
        parts = self.invariance.get(backend)
        return None if not parts else combine(parts)

    @property
    def passed(self) -> bool:
        cells = [self.cell(a, b) for a, b in self.pairs]
        inv = [self.invariant(b) for b in self.invariance]
        return not self.errors and all(c.passed for c in cells + inv if c is not None)

    def failures(self) -> list[str]:
        out = list(self.errors)
        for a, b in self.pairs:
            c = self.cell(a, b)
            if c is not None and not c.passed:
                out.append(f"{self.name}: {a} vs {b}: {c.detail} (max_abs {c.max_abs:.3g}, max_rel {c.max_rel:.3g})")
        for name in self.invariance:
            c = self.invariant(name)
            if not c.passed:
                out.append(f"{self.name}: {name} changes across plans/layouts: {c.detail}")
        return out

    def add_pair(self, a: str, b: str, out: Agreement, stats=()):
        self.pairs.setdefault((a, b), []).append((out, list(stats)))

    def merge(self, other: Row) -> Row:
        self.cases += other.cases
        for k, v in other.pairs.items():
            self.pairs.setdefault(k, []).extend(v)
        for k, v in other.invariance.items():
            self.invariance.setdefault(k, []).extend(v)
        self.bitwise_required |= other.bitwise_required
        for k, v in other.not_run.items():
            self.not_run.setdefault(k, set()).update(v)
        self.ran |= other.ran
        self.errors += other.errors
        self.crossings += other.crossings
        self.seconds += other.seconds
        for k, v in other.backend_seconds.items():
            self.backend_seconds[k] = self.backend_seconds.get(k, 0.0) + v
        return self

    def finish(self):
        """Drop not-run reasons of backends that did run some case of the row."""
        for name in list(self.not_run):
            if name in self.ran:
                del self.not_run[name]
        return self


def merge_rows(rows: list[Row]) -> list[Row]:
    """Rows of the same level and name folded into one, first-seen order."""
    merged: dict[tuple[str, str], Row] = {}
    for r in rows:
        key = (r.level, r.name)
        if key in merged:
            merged[key].merge(r)
        else:
            merged[key] = r
    return [r.finish() for r in merged.values()]


def _backends(only=None):
    return [b for b in B.BACKENDS if only is None or b.name in only]


def backend_error(name: str, what: str, e: Exception) -> str:
    tb = traceback.format_exception_only(type(e), e)[-1].strip()
    return f"{what}: {name} raised {tb}"


# ----------------------------------------------------------------------------- kernel level


def kernel_inputs(case: KernelCase) -> B.KernelInputs:
    dt, dev = B.TORCH_DTYPES[case.dtype], B.TORCH_DEVICE
    t = lambda a, dtype=None: None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype)  # noqa: E731
    return B.KernelInputs(
        q=t(case.q, dt),
        kv=t(case.kv, dt),
        indices=t(case.indices),
        sm_scale=case.sm_scale,
        attn_sink=t(case.sink),
        topk_length=t(case.topk_length),
    )


def check_crossing(inputs: B.KernelInputs) -> int:
    """Assert the JAX copies of the inputs are the torch tensors' bits; returns tensors checked."""
    n = 0
    for name, j in inputs.crossed().items():
        t = getattr(inputs, name)
        if t is None:
            continue
        if not B.same_bits(t, j):
            raise AssertionError(f"{name}: bits differ after crossing to JAX by DLPack")
        n += 1
    return n


def run_kernel_case(case: KernelCase, only=None) -> Row:
    """One kernel case on every backend; a Row named after the case's class and dtype."""
    row = Row("kernel", case.row, [case.describe()])
    t0 = time.perf_counter()
    x = kernel_inputs(case)
    results = {}
    for be in _backends(only):
        reason = B.why_not(be, case.dtype, case.head_dim, case.tiny)
        if reason is not None:
            row.not_run.setdefault(be.name, set()).add(reason)
            continue
        try:
            tb = time.perf_counter()
            if be.framework == "jax" and not row.crossings:
                row.crossings += check_crossing(x)
            results[be.name] = B.run_kernel(be.name, x)
            row.ran.add(be.name)
            row.backend_seconds[be.name] = time.perf_counter() - tb
        except Exception as e:  # a backend failure is a result, reported like a mismatch
            row.errors.append(backend_error(be.name, case.describe(), e))
    if "oracle" in results:  # the oracle's scale and special values are every pair's reference
        oref, mref, lref = results["oracle"]
        for a, b in itertools.combinations(results, 2):
            (oa, ma, la), (ob, mb, lb) = results[a], results[b]
            stats = [
                compare_stat(ma, mb, mref, case.dtype, "max_logits"),
                compare_stat(la, lb, lref, case.dtype, "lse"),
            ]
            row.add_pair(a, b, compare_out(oa, ob, oref, case.dtype), stats)
    row.seconds = time.perf_counter() - t0
    return row


def run_kernel_cases(cases: list[KernelCase], only=None) -> list[Row]:
    return merge_rows([run_kernel_case(c, only) for c in cases])


# ----------------------------------------------------------------------------- prefill level


JUNK = int(np.iinfo(np.int32).max)


def make_cache(arrays, page_size: int, dtype: torch.dtype, *, seed: int = 0) -> B.Cache:
    """One KV source from per-request (len_i, D) arrays, in both layouts, as torch tensors.

    Packed rows are padded to a bucket (zeros); pages are shuffled across requests (as
    `tests/cases.PrefillCase.paged` does), unused slots and spare pages NaN; block table and
    request count padded to buckets too, so that cases of one family share JAX programs. Block
    table slots past a request's pages, and table rows and offsets past the batch, hold junk
    (int32 max, -7): a backend that read one would crash or show NaN.
    """
    arrays = [np.asarray(a, np.float64) for a in arrays]
    D = arrays[0].shape[1]
    lens = [a.shape[0] for a in arrays]
    total = sum(lens)
    n_req = B.padded(len(arrays), 8)
    rows = np.zeros((B.padded(total, 2048), D))
    rows[:total] = np.concatenate(arrays)
    offsets = np.full(n_req, JUNK, np.int32)
    offsets[: len(arrays)] = np.concatenate([[0], np.cumsum(lens)[:-1]])
    counts = [-(-n // page_size) for n in lens]
    used = sum(counts) + 1
    n_pages = B.padded(used, 256)
    perm = np.random.default_rng(seed).permutation(used)
    pages = np.full((n_pages, page_size, D), np.nan)
    table = np.full((n_req, B.padded(max(max(counts), 1), 64)), JUNK, np.int32)
    table[len(arrays) :] = -7
    k = 0
    for i, a in enumerate(arrays):
        for j in range(counts[i]):
            table[i, j] = perm[k]
            chunk = a[j * page_size : (j + 1) * page_size]
            pages[perm[k], : chunk.shape[0]] = chunk
            k += 1
    t = lambda x: torch.from_numpy(x).to(B.TORCH_DEVICE)  # noqa: E731
    return B.Cache(t(rows).to(dtype), t(offsets), lens, t(pages).to(dtype), t(table))


def step_inputs(case: StepCase) -> dict[P.LayerKind, B.LayerInputs]:
    """Each layer's inputs as torch tensors in the case's dtype (JAX crosses them by DLPack).

    bf16 steps take FlashMLA's data scale, whose tolerance is made for it: latents x 0.1 and
    queries x 10 (the logits are unchanged, the outputs shrink 10x)."""
    dt, dev = B.TORCH_DTYPES[case.dtype], B.TORCH_DEVICE
    kv_scale = 0.1 if case.dtype == "bfloat16" else 1.0
    out = {}
    for kind, c in case.layers.items():
        raw = make_cache([kv_scale * x for x in c.raw], case.block_size, dt, seed=1)
        comp = None
        if kind.has_compressed:
            comp = make_cache([kv_scale * x for x in c.comp], max(1, case.block_size // c.ratio), dt, seed=2)
        topk = torch.from_numpy(c.topk_rows).to(dev) if kind is P.LayerKind.CSA else None
        q = torch.from_numpy(c.q / kv_scale).to(dev, dt)
        out[kind] = B.LayerInputs(c.layer, q, torch.from_numpy(c.sink).to(dev), topk, raw, comp)
    return out


def check_step_crossing(layers: dict[P.LayerKind, B.LayerInputs], padded: int) -> int:
    n = 0
    for x in layers.values():
        q, topk, sink = x.jax_q(padded)
        pairs = [(x.q, q[: x.q.shape[0]]), (x.sink, sink)] + (
            [(x.topk, topk[: x.topk.shape[0]])] if x.topk is not None else []
        )
        for cache in (x.raw, x.comp):
            if cache is None:
                continue
            for layout in ("paged", "logical"):
                src = cache.jax_source(layout)
                pairs += (
                    [(cache.pages, src.pages), (cache.table, src.block_table)]
                    if layout == "paged"
                    else [(cache.rows, src.rows), (cache.offsets, src.offsets)]
                )
        for t, j in pairs:
            if not B.same_bits(t, j):
                raise AssertionError("prefill inputs: bits differ after crossing to JAX by DLPack")
            n += 1
    return n


def _variants_for(case: StepCase, be: B.Backend):
    st = B.machine_status()[be.name]
    if be.framework == "numpy":
        return [PRIMARY]  # the oracle never sees a plan
    vs = list(case.variants) if (be.reference or not st.interpreted) else [PRIMARY]
    if be.framework == "jax":
        vs = [v for v in vs if v[1] in case.jax_layouts]
    return vs


def run_step_case(case: StepCase, only=None) -> list[Row]:
    """One step case on every backend, plan and layout; one Row per layer kind."""
    t0 = time.perf_counter()
    rows = {k: Row("prefill", case.row(k), [case.describe()]) for k in case.layers}
    layers = step_inputs(case)
    sm_scale = case.first.sm_scale
    outputs = {}  # backend -> {variant -> {kind: out}}
    crossings = 0
    for be in _backends(only):
        reason = B.why_not(be, case.dtype, case.head_dim, case.tiny)
        if reason is not None:
            for row in rows.values():
                row.not_run.setdefault(be.name, set()).add(reason)
            continue
        tb = time.perf_counter()
        try:
            if be.framework == "jax" and not crossings:
                padded = B.padded(case.batch.num_tokens, B.JAX_PREFILL_META["min_tokens"])
                crossings = check_step_crossing(layers, padded)
            per_variant = {}
            for v in _variants_for(case, be):
                step = P.plan_step(case.batch, case.plan_config(v), case.layer_specs)
                per_variant[v] = B.run_prefill(be.name, step, layers, v[1], case.topk, sm_scale)
            if case.splits:
                per_variant["split"] = _run_split(be.name, case, layers, sm_scale)
            outputs[be.name] = per_variant
            for row in rows.values():
                row.ran.add(be.name)
                row.backend_seconds[be.name] = (time.perf_counter() - tb) / len(rows)
        except Exception as e:
            for row in rows.values():
                row.errors.append(backend_error(be.name, case.describe(), e))
    oracle = outputs.get("oracle", {}).get(PRIMARY)
    for r, row in rows.items():
        row.crossings = crossings
        if oracle is None:
            continue
        ref = oracle[r]
        for a, b in itertools.combinations(outputs, 2):
            va, vb = outputs[a], outputs[b]
            shared = [v for v in va if v in vb] if a != "oracle" else list(vb)
            for v in shared:
                got_a = va[PRIMARY if a == "oracle" else v][r]
                row.add_pair(a, b, compare_out(got_a, vb[v][r], ref, case.dtype))
        for name, per_variant in outputs.items():
            if name == "oracle" or PRIMARY not in per_variant:
                continue
            required = B.BY_NAME[name].reference and case.dtype == "float32"
            if required:
                row.bitwise_required.add(name)
            base = per_variant[PRIMARY][r]
            for v, res in per_variant.items():
                if v == PRIMARY:
                    continue
                row.invariance.setdefault(name, []).append(bitwise_agreement(base, res[r], ref, required, v))
    elapsed = time.perf_counter() - t0
    for row in rows.values():
        row.seconds = elapsed / len(rows)
    return list(rows.values())


def bitwise_agreement(a: np.ndarray, b: np.ndarray, ref: np.ndarray, required: bool, variant) -> Agreement:
    """Plan invariance of one backend: output `b` of `variant` against `a` of the primary plan;
    passes if bit-identical, or always when bitwise equality is not `required` (figures only)."""
    label = variant if isinstance(variant, str) else "/".join(variant)
    if a.shape != b.shape:
        return Agreement(np.inf, np.inf, False, f"{label}: shape {b.shape} vs {a.shape}")
    diff = np.abs(a - b)
    if np.isnan(diff).any():
        return Agreement(np.nan, np.nan, False, f"{label}: NaN")
    max_abs = float(diff.max(initial=0.0))
    scale = float(np.abs(ref).max(initial=0.0))
    ok = max_abs == 0 or not required
    return Agreement(
        max_abs, max_abs / scale if scale else 0.0, ok, "" if ok else f"{label}: not bitwise (max_abs {max_abs:.3g})"
    )


def _run_split(name: str, case: StepCase, layers, sm_scale):
    """The one-request prompt of `case` prefilled over several steps, outputs concatenated."""
    parts = []
    seq = case.first.seq_lens[0]
    # every step padded to the one-step token bucket: one JAX program per kind for all steps
    jax_meta = dict(padded_tokens=B.padded(seq, B.JAX_PREFILL_META["min_tokens"]))
    for a, b in case.splits:
        batch = P.PrefillBatch([b], [b - a])
        step = P.plan_step(batch, case.plan_config(PRIMARY), case.layer_specs)
        sub = {k: x.tokens(a, b) for k, x in layers.items()}
        parts.append(B.run_prefill(name, step, sub, PRIMARY[1], case.topk, sm_scale, jax_meta=jax_meta))
    assert case.splits[-1][1] == seq
    return {k: np.concatenate([p[k] for p in parts]) for k in layers}
