"""The parity suite's DeepSeek-V4.1 rows: whole V4.1 steps of the tiny schedule on every backend.

A case (`V41StepCase`) is one step of `tests.v41_prefill_cases` (ratios 0 / 2 / 1, shared
compressed caches, -1 picks, prefix hits, replay on or off): every layer of the schedule runs
through each framework's public prefill (`build_step_metadata(step).for_layer(i)`, the band's rows
only) under every plan and cache layout of the case, against the float64 oracle's
`planner.oracle.layer_attention`. One report row per (case class, plan key, dtype): a row holds
every layer reading that plan (e.g. "V4.1 tiny, replay · r1 replay · fp32": layers 4-6). Cache
layouts: "paged" (shuffled pages, NaN in unused slots), "logical" (packed rows, junk offsets past
the batch) and "mxfp8" (DeepSeek-V4.1's 528-byte records, vLLM's interleaved layout; D = 512).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import torch

import planner as P
from dsv4_jax import prefill as JP
from dsv4_torch import prefill as TP
from tests import v41_record_cases as R
from tests.parity import backends as B
from tests.parity.cases import DTYPE_TAG
from tests.parity.harness import Row, backend_error, bitwise_agreement, make_cache
from tests.parity.tolerances import compare_out
from tests.v41_prefill_cases import V41Case, v41_case

V41_VARIANTS = (  # (plan config, cache layout); the first is the primary one every backend runs
    ("adaptive", "paged"),
    ("adaptive", "logical"),
    ("per_request", "paged"),
    ("adaptive+tight-budget", "paged"),
)
POLICY = {
    "adaptive": {},
    "per_request": {"policy": "per_request"},
    "adaptive+tight-budget": {"budget_rows": 200},  # splits the 150-token request (ratio 1: 150 + 60 + 15 rows)
}
JAX_META = dict(token_tile=16, gather_tile=64, min_tokens=64, min_workspace_rows=1024)


@dataclass
class V41StepCase:
    klass: str
    case: V41Case
    dtype: str = "float32"
    variants: tuple = V41_VARIANTS
    tiny: bool = True  # small enough for the interpreters on CPU
    family: str = "v41-tiny"

    @property
    def name(self) -> str:
        return self.case.name

    @property
    def head_dim(self) -> int:
        return self.case.head_dim

    def row(self, key: P.PlanKey) -> str:
        what = f"r{key.compress_ratio}" + ("" if key.band == "full" else f" {key.band}")
        return f"{self.klass} · {what} · {DTYPE_TAG[self.dtype]}"

    def describe(self) -> str:
        b = self.case.batch
        return (
            f"{self.name} (seq_lens={b.seq_lens.tolist()} query_lens={b.query_lens.tolist()} "
            f"replay_start={None if b.replay_start is None else b.replay_start.tolist()} "
            f"replay={self.case.replay} W={self.case.window_size} topk={self.case.index_topk} D={self.head_dim})"
        )


def v41_step_cases() -> list[V41StepCase]:
    """Every V4.1 prefill case, fixed seeds (the tiny schedule: W = 16, top-k 8, H = 2, D = 16)."""
    mixed = dict(seq_lens=[90, 40, 64, 21, 150], query_lens=[30, 40, 20, 0, 60], replay_start=[24, 0, 30, 0, 0])
    return [
        V41StepCase("V4.1 tiny, replay", v41_case("replay", **mixed, seed=11)),
        V41StepCase("V4.1 tiny, exact (replay off)", v41_case("exact", **mixed, replay=False, seed=12)),
        V41StepCase(
            "V4.1 mxfp8 pages: H=64, D=512",
            v41_case("mxfp8", [70, 33], [50, 33], replay_start=[8, 0], H=64, D=512, seed=13),
            dtype="bfloat16",
            variants=(("adaptive", "mxfp8"), ("per_request", "mxfp8")),
            tiny=False,
            family="v41-mxfp8",
        ),
    ]


class MxCache:
    """One KV source in 528-byte mxfp8 pages (interleaved), for both frameworks, and the values it holds."""

    def __init__(self, arrays, page: int, seed: int):
        pages, table, self.held = R.mxfp8_paged(arrays, page, seed, "interleaved")
        self.pages, self.table = torch.from_numpy(pages), torch.from_numpy(table)
        self._jax = None

    def torch_source(self, layout):
        return TP.PagedKV(self.pages, self.table, kv_cache_dtype="fp8_ds_mla", layout="interleaved")

    def jax_source(self, layout):
        if self._jax is None:
            self._jax = JP.PagedKV(
                B.to_jax(self.pages), B.to_jax(self.table), kv_cache_dtype="fp8_ds_mla", layout="interleaved"
            )
        return self._jax


def caches_of(sc: V41StepCase):
    """({layer: raw cache}, {KV source: compressed cache}, oracle values of both), as the case's layouts want."""
    c, dt = sc.case, B.TORCH_DTYPES[sc.dtype]
    sched = c.schedule
    if any(v[1] == "mxfp8" for v in sc.variants):
        raw = {i: MxCache(c.raw[i], 16, 100 + i) for i in range(len(sched))}
        comp = {s: MxCache(c.caches[s], 16 // sched[s].compress_ratio, 7 + s) for s in sched.kv_source_layer_ids}
        return raw, comp, {i: x.held for i, x in raw.items()}, {s: x.held for s, x in comp.items()}
    raw = {i: make_cache(c.raw[i], 8, dt, seed=i) for i in range(len(sched))}
    comp = {
        s: make_cache(c.caches[s], 8 // sched[s].compress_ratio, dt, seed=10 + s) for s in sched.kv_source_layer_ids
    }
    return raw, comp, {i: x.oracle() for i, x in raw.items()}, {s: x.oracle() for s, x in comp.items()}


def run_v41_case(sc: V41StepCase, only=None) -> list[Row]:
    """One V4.1 step on every backend, plan and cache layout; one Row per plan key of the step."""
    t0 = time.perf_counter()
    c = sc.case
    sched = c.schedule
    primary = sc.variants[0]
    st0 = c.step(**POLICY[primary[0]])
    rows = {k: Row("prefill", sc.row(k), [sc.describe()]) for k in st0.plans}
    raw, comp, raw_vals, comp_vals = caches_of(sc)
    dt = B.TORCH_DTYPES[sc.dtype]
    # bf16 cases: the oracle reads the bf16-rounded queries the backends read
    q_vals = {i: torch.from_numpy(c.q[i]).to(dt).double().numpy() for i in range(len(sched))}
    case_vals = V41Case(c.name, sched, c.batch, c.replay, q_vals, raw_vals, comp_vals, c.topk, c.sink)
    outputs: dict = {}
    for be in B.BACKENDS if only is None else [b for b in B.BACKENDS if b.name in only]:
        reason = B.why_not(be, sc.dtype, sc.head_dim, sc.tiny)
        if reason is not None:
            for row in rows.values():
                row.not_run.setdefault(be.name, set()).add(reason)
            continue
        tb = time.perf_counter()
        try:
            per_variant = {}
            variants = [primary] if be.framework == "numpy" else sc.variants
            if B.machine_status()[be.name].interpreted and not be.reference:
                variants = [primary]
            for v in variants:
                st = c.step(**POLICY[v[0]])
                per_variant[v] = _run(be, st, sc, case_vals, raw, comp, v[1], dt)
            outputs[be.name] = per_variant
            for row in rows.values():
                row.ran.add(be.name)
                row.backend_seconds[be.name] = (time.perf_counter() - tb) / len(rows)
        except NotImplementedError as e:  # a backend that cannot run these plans says so
            for row in rows.values():
                row.not_run.setdefault(be.name, set()).add(str(e))
        except Exception as e:
            for row in rows.values():
                row.errors.append(backend_error(be.name, sc.describe(), e))
    oracle = outputs.get("oracle", {}).get(primary)
    for key, row in rows.items():
        layers = st0.sharing[key]
        if oracle is None:
            continue
        for a, b in itertools.combinations(outputs, 2):
            va, vb = outputs[a], outputs[b]
            shared = [v for v in va if v in vb] if a != "oracle" else list(vb)
            for v in shared:
                for i in layers:
                    ref = oracle[i]
                    row.add_pair(a, b, compare_out(va[primary if a == "oracle" else v][i], vb[v][i], ref, sc.dtype))
        for name, per_variant in outputs.items():
            if name == "oracle" or primary not in per_variant:
                continue
            required = B.BY_NAME[name].reference and sc.dtype == "float32"
            if required:
                row.bitwise_required.add(name)
            for v, res in per_variant.items():
                if v == primary:
                    continue
                for i in layers:
                    agreement = bitwise_agreement(per_variant[primary][i], res[i], oracle[i], required, v)
                    row.invariance.setdefault(name, []).append(agreement)
    elapsed = time.perf_counter() - t0
    for row in rows.values():
        row.seconds = elapsed / len(rows)
    return list(rows.values())


def _run(be: B.Backend, st: P.StepPlan, sc: V41StepCase, vals: V41Case, raw, comp, layout: str, dt):
    """{layer: (T_band, H, d_v) float64} of one backend for one step (one plan, one cache layout)."""
    st_name = B.machine_status()[be.name]
    sched = vals.schedule
    out = {}
    if be.framework == "numpy":
        for i in range(len(sched)):
            out[i] = vals.oracle(i)[1]
        return out
    if be.framework == "torch":
        meta = TP.build_step_metadata(st, device=B.TORCH_DEVICE, index_topk=vals.index_topk)
    else:
        meta = JP.build_step_metadata(st, index_topk=vals.index_topk, **JAX_META)
    for i in range(len(sched)):
        role = sched[i]
        rows = vals.rows(i, st)
        q = torch.from_numpy(sc.case.q[i][rows]).to(B.TORCH_DEVICE, dt)
        topk = torch.from_numpy(vals.topk[role.index_source_layer_id][rows]) if role.has_compressed else None
        sink = torch.from_numpy(vals.sink[i]).to(B.TORCH_DEVICE)
        m = meta.for_layer(i)
        if be.framework == "torch":
            if q.dtype.is_floating_point and layout != "mxfp8":  # rows no chunk writes must never reach an output
                meta.workspace(q.shape[2], q.dtype).fill_(float("nan"))
            res = TP.prefill_attention(
                q,
                m,
                raw[i].torch_source(layout),
                comp[role.kv_source_layer_id].torch_source(layout) if role.has_compressed else None,
                sm_scale=vals.sm_scale,
                attn_sink=sink,
                topk_indices=None if topk is None else topk.to(B.TORCH_DEVICE),
                backend=st_name.kernel,
            )
            full = B.to_numpy(res)
        else:
            T = q.shape[0]
            pad = meta.padded_tokens - T
            qj = B.to_jax(q)
            qj = jnp.pad(qj, ((0, pad), (0, 0), (0, 0)), constant_values=jnp.nan)  # padding: NaN queries
            tj = None
            if topk is not None:
                tj = jnp.pad(B.to_jax(topk), ((0, pad), (0, 0)), constant_values=2**31 - 1)  # and junk ids
            res = JP.prefill_attention(
                qj,
                m,
                raw[i].jax_source(layout),
                comp[role.kv_source_layer_id].jax_source(layout) if role.has_compressed else None,
                sm_scale=vals.sm_scale,
                attn_sink=B.to_jax(sink),
                topk_indices=tj,
                backend=st_name.kernel,
                interpret=st_name.interpreted,
            )
            full = B.to_numpy(res)
            if np.any(full[T:]):
                raise AssertionError(f"{be.name}: padding rows past the {T} band rows are not 0")
            full = full[:T]
        if m.last_backend != st_name.kernel:
            raise AssertionError(f"{be.name}: asked for {st_name.kernel!r}, ran {m.last_backend!r}")
        out[i] = full
    return out


def run_v41_cases(cases: list[V41StepCase], only=None) -> list[Row]:
    from tests.parity.harness import merge_rows

    return merge_rows([r for c in cases for r in run_v41_case(c, only)])
