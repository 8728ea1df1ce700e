"""Backend "mosaic_tpu" (`dsv4_jax.kernels.mosaic_tpu.attention`, `dsv4_jax.kernels.mosaic_tpu.prefill`) in TPU interpret mode on CPU.

TPU interpret mode simulates HBM, VMEM, SMEM, every DMA and semaphore (jax 0.10.2 and 0.12); each
simulated access is a Python callback (about 1-5 ms here), and a kernel gathers its keys row by
row, so cases are small and use 8- or 32-row key blocks (`override_block_k`; the compiled kernels
use the chips' 128 / 256, `test_mosaic_tpu_compile.py`). By default (CI) one case proves each
point; the full matrix (every parity kernel case, FlashMLA's model widths, every plan and cache
layout and every kind in fp8, the JAX model generating tokens) runs with DSV4_TPU_FULL=1:
`make test-tpu-full`.

1. FlashMLA's contract on a flat workspace, against the float64 oracle on the same bf16-rounded
   inputs within the parity table's bounds (tests/parity/tolerances.py): FlashMLA-style cases
   (bf16 and float32, invalid and duplicate indices, -1 tails past topk_length, sinks -inf / 0 /
   30 / 1e4 / +inf, tokens without a key), NaN propagation, and a multi-block, multi-grid-step
   run with race detection on; the parity suite's kernel cases in the full matrix.
2. The prefill layer (plan-driven tiles, keys straight from the caches): oracle agreement for every
   kind; the same bits for every plan (adaptive, fixed, per_request, a tight budget, a prompt
   split over steps) and for paged and packed caches; fp8_ds_mla pages == bf16 rows holding the
   dequantized values, bit for bit (CSA with race detection on); VMEM refused up front.
3. Wiring: names, "auto" on TPU devices, the errors for what the kernel does not serve.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
import planner as P
from dsv4_jax import prefill as JP
from dsv4_jax import prefill_metadata as PM
from dsv4_jax.kernels.mosaic_tpu import attention as M
from dsv4_jax.kernels.mosaic_tpu import rows as R
from planner import oracle
from tests.cases import make_case
from tests.parity import cases as C
from tests.parity import tolerances as TOL

pytestmark = pytest.mark.skipif(M.unavailable_reason() is not None, reason=f"Pallas TPU: {M.unavailable_reason()}")

BK = 32  # key rows per block in interpret mode
FULL = os.environ.get("DSV4_TPU_FULL") == "1"
full_matrix = pytest.mark.skipif(not FULL, reason="the full mosaic_tpu matrix runs in make test-tpu-full")


def _f64(x):
    return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _oracle(q, kv, idx, sm_scale, sink, topk_length):
    return oracle.sparse_attention(_f64(q), _f64(kv), np.asarray(idx), sm_scale, _f64(sink), topk_length)


def _flat(q, kv, idx, sm_scale, sink=None, topk_length=None, *, races=False, block_k=BK):
    as_jax = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    if races:
        M.reset_interpret_state()
    got = M.sparse_attention_mosaic_tpu(
        q, kv, as_jax(idx), sm_scale, as_jax(sink), as_jax(topk_length), interpret=True, detect_races=races,
        block_k=block_k,
    )  # fmt: skip
    if races:
        assert not M.races_found(), "TPU interpret mode found a race"
    return tuple(_f64(x) for x in got)


def _within_bounds(got, ref, dtype):
    out, mx, lse = got
    checks = [
        TOL.compare_out(out, ref[0], ref[0], dtype),
        TOL.compare_stat(mx, ref[1], ref[1], dtype, "max_logits"),
        TOL.compare_stat(lse, ref[2], ref[2], dtype, "lse"),
    ]
    bad = [c.detail for c in checks if not c.passed]
    assert not bad, bad


def _check(q, kv, idx, sm_scale, sink=None, topk_length=None, dtype="bfloat16", **kw):
    jdt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    q, kv = jnp.asarray(q, jdt), jnp.asarray(kv, jdt)
    got = _flat(q, kv, idx, sm_scale, sink, topk_length, **kw)
    _within_bounds(got, _oracle(q, kv, idx, sm_scale, sink, topk_length), dtype)
    return got


# --- 1. the flat contract ---------------------------------------------------------------------

_PARITY = {(c.klass, c.name, c.dtype): c for c in C.kernel_cases()}
PARITY_FAST = [("rows without a valid key", "T = 0", "bfloat16")]  # the rest: the FlashMLA-style cases below
PARITY_SLOW = [k for k in _PARITY if k not in PARITY_FAST]


def _parity_case(key):
    c = _PARITY[key]
    _check(c.q, c.kv, c.indices, c.sm_scale, c.sink, c.topk_length, dtype=c.dtype)


@pytest.mark.parametrize("key", PARITY_FAST, ids=["-".join(k) for k in PARITY_FAST])
def test_parity_kernel_cases(key):
    _parity_case(key)


@full_matrix
@pytest.mark.parametrize("key", PARITY_SLOW, ids=["-".join(k) for k in PARITY_SLOW])
def test_parity_kernel_cases_all(key):
    _parity_case(key)


def _flashmla_case(seed, H, D, S, K, topk_length, invalid=0.2, duplicates=0.2):
    """FlashMLA's data (kv ~ N(0, 0.1^2)), every invalid form, duplicates, a -1 tail past each
    token's topk_length, and sinks -inf, 0, 30, 1e4, +inf on heads 0-4."""
    rng = np.random.default_rng(seed)
    T = len(topk_length)
    q, kv = C.random_inputs(rng, T, H, D, S, "bfloat16")
    idx = C.random_indices(rng, T, S, K, invalid=invalid, duplicates=duplicates)
    topk_length = np.asarray(topk_length, np.int32)
    idx[np.arange(K)[None, :] >= topk_length[:, None]] = -1
    special = np.array([-np.inf, 0.0, 30.0, 1e4, np.inf], np.float32)
    sink = np.concatenate([special, rng.standard_normal(H - len(special)).astype(np.float32)])
    return q, kv, idx, sink, topk_length


FLASHMLA_FAST = [(16, 576, 160, [160, 70, 0], "bfloat16"), (64, 512, 96, [96, 33], "float32")]
FLASHMLA_SLOW = [
    (64, 512, 96, [96, 33], "bfloat16"),
    (32, 512, 1024, [1024, 129], "bfloat16"),
    (64, 576, 2048, [2048], "bfloat16"),
    (128, 512, 1152, [1152], "bfloat16"),
    (128, 576, 512, [512, 33], "bfloat16"),
]


def _flashmla(H, D, K, topk_length, dtype, S=4000):
    q, kv, idx, sink, tl = _flashmla_case(H + D + K, H, D, S, K, topk_length)
    out, max_logits, lse = _check(q, kv, idx, D**-0.5, sink, tl, dtype=dtype, block_k=BK if K < 512 else 128)
    assert np.all(out[:, 3] == 0) and np.all(out[:, 4] == 0)  # sinks 1e4 and +inf take all the weight
    if 0 in list(topk_length):  # a token without a key: exactly 0 / -inf / +inf
        t = list(topk_length).index(0)
        assert not out[t].any() and np.all(np.isneginf(max_logits[t])) and np.all(np.isposinf(lse[t]))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the oracle's exp(1e4 - lse)
@pytest.mark.parametrize(
    "H, D, K, topk_length, dtype", FLASHMLA_FAST, ids=[f"H{c[0]}-D{c[1]}-K{c[2]}-{c[4]}" for c in FLASHMLA_FAST]
)
def test_flashmla_style_cases(H, D, K, topk_length, dtype):
    _flashmla(H, D, K, topk_length, dtype, S=40)


@full_matrix
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(
    "H, D, K, topk_length, dtype", FLASHMLA_SLOW, ids=[f"H{c[0]}-D{c[1]}-K{c[2]}" for c in FLASHMLA_SLOW]
)
def test_flashmla_style_cases_model_widths(H, D, K, topk_length, dtype):
    _flashmla(H, D, K, topk_length, dtype)


def test_nan_propagates_like_the_oracle():
    """NaN in one token's q head or in a gathered kv row gives NaN in exactly the oracle's rows;
    rows nobody reads may hold NaN (row 0 included); a token without a valid key stays 0 / -inf /
    +inf even with NaN in its q."""
    rng = np.random.default_rng(8)
    T, H, D, S, K = 8, 16, 512, 64, 256  # the parity cases' bf16 shape: their compiled program
    q, kv = C.random_inputs(rng, T, H, D, S, "bfloat16")
    idx = rng.integers(1, 40, (T, K)).astype(np.int32)
    idx[:, 40:] = -1  # a short row: fewer simulated DMAs
    idx[:, 1:][idx[:, 1:] == 7] = 8  # only token 2 (column 0) reads row 7
    idx[2, 0] = 7
    idx[3] = -1  # token 3: no valid key
    idx[4:] = -1
    q[0, 5, 3] = np.nan
    q[3, :, 0] = np.nan
    kv[7, 11] = np.nan
    kv[0] = np.nan
    kv[40:] = np.nan  # unreferenced
    sink = rng.standard_normal(H).astype(np.float32)
    q, kv = jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16)
    got = _flat(q, kv, idx, D**-0.5, sink)
    ref = _oracle(q, kv, idx, D**-0.5, sink, None)
    nan_rows = np.zeros((T, H), bool)  # tokens 4-7: no key either
    nan_rows[0, 5] = nan_rows[2] = True
    for name, g, r in zip(("out", "max_logits", "lse"), got, ref):
        np.testing.assert_array_equal(np.isnan(r).reshape(T, H, -1).any(-1), nan_rows, err_msg=f"oracle {name}")
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r), err_msg=name)
    clean = ~nan_rows
    _within_bounds(tuple(x[clean] for x in got), tuple(x[clean] for x in ref), "bfloat16")


def test_no_race_over_blocks_tokens_and_grid_steps():
    """Race detection on: 9 tokens (two grid steps of 8), up to 3 key blocks each, odd S (a padded
    partner row), a token whose blocks end early: the double-buffered DMAs never overlap a read."""
    rng = np.random.default_rng(3)
    T, H, D, S, K = 9, 16, 512, 97, 80
    q, kv = C.random_inputs(rng, T, H, D, S, "bfloat16")
    idx = C.random_indices(rng, T, S, K, invalid=0.1, duplicates=0.2)
    tl = np.array([80, 33, 0, 64, 65, 1, 80, 31, 80], np.int32)
    _check(q, kv, idx, D**-0.5, None, tl, races=True)


# --- 2. the prefill layer ---------------------------------------------------------------------

POLICIES = ("adaptive", "fixed", "per_request")
PREFILL_META = dict(token_tile=16, gather_tile=16, min_tokens=32, min_workspace_rows=256)


def _prefill_case(kind: str):
    ratio = {"SWA": 0, "CSA": 4, "HCA": 8}[kind]
    # queries crossing ratio / window / tile boundaries; request 1 starts mid-history
    return make_case(f"tpu-{kind}", [19, 45], [19, 21], ratio, kind=kind, window_size=8, topk=6, H=4, D=32, seed=7)


def _caches(case, layout, dtype):
    if layout == "paged":
        out = []
        for which, seed in (("raw", 1), ("comp", 2)):
            if which == "comp" and not case.kind.has_compressed:
                out.append(None)
                continue
            pages, table = case.paged(which, seed=seed)
            out.append(JP.PagedKV(jnp.asarray(pages, dtype), jnp.asarray(table)))
        return out
    rows = lambda xs: JP.LogicalKV.from_list([np.asarray(x, np.float32).astype(dtype) for x in xs])  # noqa: E731
    return rows(case.raw), (rows(case.comp) if case.kind.has_compressed else None)


def _prefill(case, step, *, layout="logical", dtype=np.float32, raw=None, comp=None, races=False):
    smeta = JP.build_step_metadata(step, index_topk=case.topk, **PREFILL_META)
    meta = smeta[case.kind]
    if raw is None:
        raw, comp = _caches(case, layout, dtype)
    q = jnp.asarray(smeta.pad_tokens(np.asarray(case.q, np.float32)).astype(dtype))
    n = case.q.shape[0]
    topk = smeta.pad_tokens(case.topk_rows[:n]) if case.kind is P.LayerKind.CSA else None
    interpret = True
    if races:
        from jax.experimental.pallas import tpu as pltpu

        M.reset_interpret_state()
        interpret = pltpu.InterpretParams(detect_races=True)
    with M.override_block_k(8):
        out = JP.prefill_attention(
            q, meta, raw, comp, sm_scale=case.sm_scale, attn_sink=jnp.asarray(case.sink), topk_indices=topk,
            backend="mosaic_tpu", interpret=interpret,
        )  # fmt: skip
    assert meta.last_backend == "mosaic_tpu"
    if races:
        assert not M.races_found(), "TPU interpret mode found a race"
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert not out[n:].any()  # rows of no planned token stay 0
    return out[:n]


def _step(case, **cfg):
    return P.plan_step(case.batch, case.plan_config(**cfg), [case.layer])


def _plans_bitwise(kind, variants):
    case = _prefill_case(kind)
    want, _, _ = case.oracle()
    ref = _prefill(case, _step(case))
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    tight = max(s // case.ratio if case.ratio else 0 for s in case.seq_lens) + case.window_size + 4
    for cfg in variants:
        cfg = dict(cfg)
        layout = cfg.pop("layout", "logical")
        if cfg.pop("tight", False):
            cfg["budget_rows"] = tight
        out = _prefill(case, _step(case, **cfg), layout=layout)
        np.testing.assert_array_equal(out, ref, err_msg=f"{cfg} {layout}")


@pytest.mark.parametrize("kind", ["SWA", "CSA", "HCA"])
def test_prefill_matches_oracle_and_every_plan_bitwise(kind):
    """float32 caches; the same bits for the fixed and per_request plans and for a budget that
    splits requests over several chunks (the query tiles come from the batch: plans cannot change
    them, and a token's result depends on its keys only)."""
    _plans_bitwise(kind, [dict(policy="per_request", tight=True)] + ([dict(policy="fixed")] if kind == "SWA" else []))


@full_matrix
@pytest.mark.parametrize("kind", ["SWA", "CSA", "HCA"])
def test_prefill_paged_and_other_plans_bitwise(kind):
    _plans_bitwise(
        kind, [dict(policy="fixed"), dict(layout="paged"), dict(policy="per_request", layout="paged", tight=True)]
    )


def test_prompt_split_over_steps_is_bitwise_one_step():
    """Chunked prefill: a prompt fed over three steps (boundaries 5 and 17, not multiples of the
    ratio, the window or the tile) == the same prompt in one step, bit for bit (HCA layer)."""
    case = _prefill_case("HCA")
    ref = _prefill(case, _step(case))
    seq = case.seq_lens[1]
    got = []
    for a, b in ((0, 5), (5, 17), (17, 21)):  # request 1's new tokens: positions seq - 21 + a ..
        part = make_case("split", [seq - 21 + b], [b - a], case.ratio, kind="HCA", window_size=8, topk=6, H=4, D=32)
        part.q = case.q[19 + a : 19 + b]
        part.raw = [case.raw[1][: seq - 21 + b]]
        part.comp = [case.comp[1][: (seq - 21 + b) // case.ratio]]
        part.sink = case.sink
        got.append(_prefill(part, _step(part)))
    np.testing.assert_array_equal(np.concatenate(got), ref[19:])


def _fp8(p):
    return JP.PagedKV(p.pages, p.block_table, kv_cache_dtype="fp8_ds_mla", block_size=p.block_size)


def _fp8_equals_bf16_rows(ratio, races=False):
    from tests.fp8_cases import fp8_cases

    case, raw, comp = fp8_cases(ratio)[1]
    step = _step(case)
    rows = lambda xs: JP.LogicalKV.from_list([jnp.asarray(x, jnp.bfloat16) for x in xs])  # noqa: E731
    fp8 = dict(raw=_fp8(raw), comp=_fp8(comp) if comp else None)
    a = _prefill(case, step, dtype=jnp.bfloat16, races=races, **fp8)
    b = _prefill(case, step, dtype=jnp.bfloat16, raw=rows(case.raw), comp=rows(case.comp) if comp else None)
    np.testing.assert_array_equal(a, b)  # pages dequantized in VMEM == the same values as bf16 rows
    want, _, _ = case.oracle()
    assert TOL.compare_out(a, want, want, "bfloat16").passed


def test_fp8_pages_equal_dequantized_bf16_rows():
    """CSA, race detection on: raw pages of 16 slots (the window, 4 pages' scale rows per tile)
    and compressed pages of 4 slots (top-k slots gathered one 4-row group each, their scale groups
    copied from the tile's VMEM copy of up to 33 pages' scale rows, zero groups for the -1 / past
    visible columns)."""
    _fp8_equals_bf16_rows(4, races=True)


@full_matrix
@pytest.mark.parametrize("ratio", [0, 128])
def test_fp8_pages_equal_dequantized_bf16_rows_other_kinds(ratio):
    """SWA, and HCA's dense compressed tiles over pages of 2 slots."""
    _fp8_equals_bf16_rows(ratio)


def test_vmem_is_refused_up_front():
    """A request's compressed pages whose fp8 scale rows cannot fit the chip's VMEM: a clear
    error naming the block table, before anything is compiled or run."""
    from tests.fp8_cases import fp8_cases

    case, raw, comp = fp8_cases(4)[1]
    huge = jnp.zeros((comp.block_table.shape[0], 200_000), jnp.int32)  # 200K pages per request
    comp_kv = JP.PagedKV(jnp.asarray(comp.pages), huge, kv_cache_dtype="fp8_ds_mla", block_size=comp.block_size)
    with pytest.raises(ValueError, match=r"block_table: backend 'mosaic_tpu' needs about .* MiB of VMEM"):
        _prefill(case, _step(case), dtype=jnp.bfloat16, raw=_fp8(raw), comp=comp_kv)


def test_query_tiles_come_from_the_batch():
    batch = P.PrefillBatch([40, 5, 100, 7], [33, 0, 17, 7])
    tiles = PM.query_tiles(batch, 16)
    np.testing.assert_array_equal(
        tiles,
        [[0, 16, 32, 33, 49, 50], [16, 16, 1, 16, 1, 7], [0, 0, 0, 2, 2, 3], [7, 23, 39, 83, 99, 0]],
    )
    tables = []
    for p in POLICIES:
        cfg = P.PlanConfig(window_size=8, max_model_len=128, max_num_batched_tokens=64, policy=p)
        tables.append(np.asarray(JP.build_step_metadata(P.plan_step(batch, cfg, [P.LayerSpec("HCA", 8)]))["HCA"].table))
    for t in tables[1:]:
        np.testing.assert_array_equal(t[PM.TILE_Q_ROW :], tables[0][PM.TILE_Q_ROW :])
    assert int(tables[0][PM.SCALARS, 3]) == 6


# --- 3. wiring ----------------------------------------------------------------------------------


def test_backend_name_interpret_option_and_errors():
    q = jnp.zeros((2, 16, 512), jnp.bfloat16)
    kv, idx = jnp.zeros((8, 512), jnp.bfloat16), jnp.zeros((2, 32), jnp.int32)
    assert "mosaic_tpu" in dsv4_jax.BACKENDS
    assert dsv4_jax.resolve_backend("mosaic_tpu", q, interpret=True) == "mosaic_tpu"
    assert dsv4_jax.resolve_backend("auto", q) != "mosaic_tpu"  # no TPU here
    assert dsv4_jax.available_backends(q)["mosaic_tpu"] is not None
    with pytest.raises(dsv4_jax.BackendUnavailableError, match="interpret=True"):
        dsv4_jax.sparse_attention(q, kv, idx, 0.1, backend="mosaic_tpu")
    with pytest.raises(dsv4_jax.BackendUnavailableError, match="interpret=True"):
        M.sparse_attention_mosaic_tpu(q, kv, idx, 0.1)
    with pytest.raises(dsv4_jax.BackendUnavailableError, match="backend='xla' .* no interpret mode"):
        dsv4_jax.sparse_attention(q, kv, idx, 0.1, backend="xla", interpret=True)
    with pytest.raises(ValueError, match="q: backend 'mosaic_tpu' takes bfloat16 or float32, got float16"):
        M.sparse_attention_mosaic_tpu(q.astype(jnp.float16), kv.astype(jnp.float16), idx, 0.1, interpret=True)
    with pytest.raises(ValueError, match="detect_races: needs interpret mode"):
        M.sparse_attention_mosaic_tpu(q, kv, idx, 0.1, detect_races=True)
    # through the public entry point, layouts (S, 1, D) / (T, 1, K), eagerly and under jit
    rng = np.random.default_rng(5)
    qq, kk = C.random_inputs(rng, 2, 16, 512, 50, "bfloat16")
    ii = C.random_indices(rng, 2, 50, 40)
    qq, kk = jnp.asarray(qq, jnp.bfloat16), jnp.asarray(kk, jnp.bfloat16)
    with M.override_block_k(BK):
        eager = dsv4_jax.sparse_attention(
            qq, kk[:, None], jnp.asarray(ii)[:, None], 0.05, backend="mosaic_tpu", interpret=True
        )
        jitted = jax.jit(lambda *a: dsv4_jax.sparse_attention(*a, 0.05, backend="mosaic_tpu", interpret=True))(
            qq, kk, jnp.asarray(ii)
        )
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _within_bounds(tuple(_f64(x) for x in eager), _oracle(qq, kk, ii, 0.05, None, None), "bfloat16")


class _FakeTPU:
    platform, device_kind, id = "tpu", "TPU v6 lite", 0


def test_auto_takes_mosaic_tpu_on_tpu_devices(monkeypatch):
    from dsv4_jax import devices

    monkeypatch.setattr(devices, "devices_for", lambda arrays: [_FakeTPU()])
    q = jnp.zeros((2, 64, 512), jnp.bfloat16)
    assert dsv4_jax.resolve_backend("auto", q) == "mosaic_tpu"
    assert dsv4_jax.resolve_backend("auto", q.astype(jnp.float32)) == "mosaic_tpu"
    assert dsv4_jax.resolve_backend("auto", q.astype(jnp.float16)) == "xla"
    assert dsv4_jax.resolve_backend("mosaic_tpu", q) == "mosaic_tpu"


def test_block_shapes_per_generation():
    for chip, width, vmem in (("v5e", 128, 128), ("v5p", 128, 64), ("v6e", 256, 128), ("7x", 256, 64), ("v4", 128, 16)):
        s = R.block_shapes(chip)
        assert (s.block_k, s.vmem_capacity) == (width, vmem * 2**20), chip
        assert s.vmem_limit == vmem * 2**20 * 3 // 4
    assert R.block_shapes(None).chip == R.INTERPRET_CHIP
    with M.compile_target("v6e", vmem_limit=2**20):
        assert M.target_chip() == "v6e" and R.block_shapes("v6e").vmem_limit == 2**20
    assert M.compile_target_chip() is None
    with pytest.raises(ValueError, match="chip: expected one of"):
        with M.compile_target("v9"):
            pass


# --- 4. the JAX model ---------------------------------------------------------------------------


def _model_tokens(ckpt, prompts, new_tokens):
    from dsv4_jax.model.generate import JaxGenerator

    opts = dict(max_batch_size=2, max_model_len=128, max_num_batched_tokens=64, min_tokens=64, min_workspace_rows=256)
    want = JaxGenerator(ckpt, backend="xla", **opts).generate(prompts, max_new_tokens=new_tokens)
    gen = JaxGenerator(ckpt, backend="mosaic_tpu", interpret=True, **opts)
    with M.override_block_k(8):
        got = gen.generate(prompts, max_new_tokens=new_tokens)
    assert got == want and all(len(o) == new_tokens for o in got)


def test_model_generates_the_xla_tokens(tiny_checkpoint_dir):
    """The tiny DeepSeek-V4 checkpoint (SWA, SWA, CSA, HCA, CSA, HCA; fp32) generates the same
    greedy tokens with backend="mosaic_tpu" (TPU interpret mode) as with "xla": a prefill step of
    a 21-token prompt, then a decode step (a tile of one token)."""
    from tests.jax.model_cases import PROMPT_B

    _model_tokens(tiny_checkpoint_dir, [PROMPT_B[:21]], 2)


@full_matrix
def test_model_generates_the_xla_tokens_ragged(tiny_checkpoint_dir):
    """A ragged prefill step of two prompts, then decode steps."""
    from tests.jax.model_cases import PROMPT_B, PROMPT_C

    _model_tokens(tiny_checkpoint_dir, [PROMPT_B[:21], PROMPT_C[:43]], 3)
