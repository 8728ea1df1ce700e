"""The Mosaic GPU kernel (`dsv4_jax.kernels.mosaic_gpu.attention`, backend "mosaic_gpu") on CPU, jax >= 0.12 only.

1. Correctness in Mosaic GPU's interpret mode (simulated shared memory, warpgroups, barriers,
   TMA and wgmma) with race detection on: every run must match the float64 oracle on the same
   bf16-rounded inputs within the parity table's bf16 bounds (tests/parity/tolerances.py) and
   report no race. Cases: a selection of the parity suite's bf16 kernel cases (T <= 8, H = 16
   or 64, K <= 640, S <= 3000) and FlashMLA-style ones at the head counts and widths FlashMLA
   serves: H 16/32/64/128, D 512/576, top-k 512-2048, one to three tokens each, invalid and
   duplicate indices, rows without a valid key, sinks -inf / 0 / 30 / 1e4 / +inf, NaN rows.
   Interpret mode costs about 0.25 s per 32-key block per 64 heads on a 2-core machine, plus a
   few seconds of tracing per new shape; the file adds 2-4 minutes to `make test-jax-new`.
2. The real (compiled) kernel lowered for sm_90a on this CPU machine, so Mosaic GPU lowering
   errors (unsupported layouts, bank-conflicting transfers, shared memory over 227 KB) show in CI.
3. Backend wiring: "mosaic_gpu" (interpreted) through `dsv4_jax.sparse_attention`, "auto" on a (pretend) Hopper,
   and the ValueErrors for inputs the kernel does not serve.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax.kernels.mosaic_gpu import attention as M
from planner import oracle
from tests.parity import cases as C
from tests.parity import tolerances as TOL

pytestmark = pytest.mark.skipif(
    M.unavailable_reason() is not None,
    reason=f"the Mosaic GPU kernel {M.unavailable_reason()} (Python >= 3.12; `make test-jax-new`)",
)


def _bf16(x):
    return jnp.asarray(x, jnp.bfloat16)


def _oracle(q, kv, idx, sm_scale, sink, topk_length):
    f64 = lambda x: None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    return oracle.sparse_attention(f64(q), f64(kv), np.asarray(idx), sm_scale, f64(sink), topk_length)


def _run_interpreted(q, kv, idx, sm_scale, sink=None, topk_length=None):
    """The kernel in interpret mode with race detection; asserts that no race was found."""
    M.reset_interpret_state()
    as_jax = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    got = M.sparse_attention_mosaic(
        q, kv, as_jax(idx), sm_scale, as_jax(sink), as_jax(topk_length), interpret=True, detect_races=True
    )
    got = tuple(np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in got)
    assert not M.races_found(), "Mosaic GPU interpret mode found a shared-memory race"
    return got


def _assert_within_bf16_bounds(got, ref):
    out, max_logits, lse = got
    r_out, r_max, r_lse = ref
    checks = [
        TOL.compare_out(out, r_out, r_out, "bfloat16"),
        TOL.compare_stat(max_logits, r_max, r_max, "bfloat16", "max_logits"),
        TOL.compare_stat(lse, r_lse, r_lse, "bfloat16", "lse"),
    ]
    bad = [c.detail for c in checks if not c.passed]
    assert not bad, bad


def _check_case(q, kv, idx, sm_scale, sink=None, topk_length=None):
    q, kv = _bf16(q), _bf16(kv)
    got = _run_interpreted(q, kv, idx, sm_scale, sink, topk_length)
    _assert_within_bf16_bounds(got, _oracle(q, kv, idx, sm_scale, sink, topk_length))
    return got


# --- 1. interpret mode against the oracle --------------------------------------------------

# Parity suite classes (tests/parity/cases.py), bf16. Left out to save time: "duplicated indices"
# and "sinks" (FLASHMLA_CASES have duplicates and every special sink), H=20 rows (not served).
PARITY_ROWS = [
    ("invalid indices", "all forms"),
    ("topk_length < valid prefix", "cuts"),
    ("rows without a valid key", "every other row"),
    ("rows without a valid key", "no key anywhere"),
    ("rows without a valid key", "T = 0"),
    ("widths K % 128 == 0 and != 0", "K=37"),
    ("NaN in unreferenced kv rows", "NaN rows"),
    ("head dims (576 = 512 + rope tail)", "H=16 D=576"),
    ("V4-Flash: H=64, K=640", "model shape"),
]
_PARITY = {(c.klass, c.name): c for c in C.kernel_cases(("bfloat16",))}


@pytest.mark.parametrize("klass, name", PARITY_ROWS, ids=[f"{k}-{n}" for k, n in PARITY_ROWS])
def test_parity_kernel_cases(klass, name):
    c = _PARITY[(klass, name)]
    _check_case(c.q, c.kv, c.indices, c.sm_scale, c.sink, c.topk_length)


def _flashmla_case(seed, T, H, D, S, K, topk_length, invalid=0.2, duplicates=0.2):
    """FlashMLA's test data (kv ~ N(0, 0.1^2)), every invalid form, duplicates, a -1 padded tail
    past each row's topk_length, and a sink per head covering -inf, 0, 30, 1e4, +inf."""
    rng = np.random.default_rng(seed)
    q, kv = C.random_inputs(rng, T, H, D, S, "bfloat16")
    idx = C.random_indices(rng, T, S, K, invalid=invalid, duplicates=duplicates)
    topk_length = np.asarray(topk_length, np.int32)
    idx[np.arange(K)[None, :] >= topk_length[:, None]] = -1
    special = np.array([-np.inf, 0.0, 30.0, 1e4, np.inf], np.float32)
    sink = np.concatenate([special, rng.standard_normal(H - len(special)).astype(np.float32)])
    return q, kv, idx, sink, topk_length


FLASHMLA_CASES = [  # (H, D, K, topk_length per token): 512-2048 keys, every head count served
    (16, 576, 512, [512, 300, 0]),
    (32, 512, 1024, [1024, 129]),
    (64, 576, 2048, [2048]),
    (128, 512, 1152, [1152]),
    (128, 576, 512, [512, 33]),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the oracle's exp(1e4 - lse)
@pytest.mark.parametrize(
    "H, D, K, topk_length", FLASHMLA_CASES, ids=[f"H{c[0]}-D{c[1]}-K{c[2]}" for c in FLASHMLA_CASES]
)
def test_flashmla_style_cases(H, D, K, topk_length):
    q, kv, idx, sink, tl = _flashmla_case(H + D + K, len(topk_length), H, D, 4000, K, topk_length)
    out, max_logits, lse = _check_case(q, kv, idx, D**-0.5, sink, tl)
    assert np.all(out[:, 3] == 0) and np.all(out[:, 4] == 0)  # sinks 1e4 and +inf take all the weight
    if 0 in topk_length:  # a token without a key: exactly 0 / -inf / +inf
        t = topk_length.index(0)
        assert not out[t].any() and np.all(np.isneginf(max_logits[t])) and np.all(np.isposinf(lse[t]))


def test_nan_propagates_like_the_oracle():
    """NaN in one token's q head or in a gathered kv row gives NaN in exactly the oracle's rows
    (out, max_logits, lse); rows nobody reads may hold NaN (row 0 included); a token without a
    valid key stays 0 / -inf / +inf even with NaN in its q."""
    rng = np.random.default_rng(8)
    T, H, D, S, K = 4, 64, 512, 48, 64
    q, kv = C.random_inputs(rng, T, H, D, S, "bfloat16")
    idx = rng.integers(1, 40, (T, K)).astype(np.int32)
    idx[:, 1:][idx[:, 1:] == 7] = 8  # only token 2 (column 0) reads row 7
    idx[2, 0] = 7
    idx[3] = -1  # token 3: no valid key
    q[0, 5, 3] = np.nan  # token 0, head 5
    q[3, :, 0] = np.nan  # token 3 (no key)
    kv[7, 11] = np.nan
    kv[0] = np.nan
    kv[40:] = np.nan  # unreferenced
    sink = rng.standard_normal(H).astype(np.float32)
    q, kv = _bf16(q), _bf16(kv)
    got = _run_interpreted(q, kv, idx, D**-0.5, sink)
    ref = _oracle(q, kv, idx, D**-0.5, sink, None)
    nan_rows = np.zeros((T, H), bool)
    nan_rows[0, 5] = True
    nan_rows[2] = True
    for name, g, r in zip(("out", "max_logits", "lse"), got, ref):
        np.testing.assert_array_equal(np.isnan(r).reshape(T, H, -1).any(-1), nan_rows, err_msg=f"oracle {name}")
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r), err_msg=name)
    clean = ~nan_rows
    _assert_within_bf16_bounds(tuple(x[clean] for x in got), tuple(x[clean] for x in ref))


# --- 2. the compiled kernel lowered for sm_90a on CPU ---------------------------------------


def _smem_recorder(monkeypatch):
    """Record the shared-memory bytes Mosaic GPU allocates per kernel (its own accounting)."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    seen = []
    original = mgpu_core._smem_tree_size

    def record(tree):
        seen.append(original(tree))
        return seen[-1]

    monkeypatch.setattr(mgpu_core, "_smem_tree_size", record)
    return seen


@pytest.mark.parametrize(
    "name, H, D, K",
    [
        ("V4-Flash", 64, 512, 640),
        ("V4-Pro", 128, 512, 1152),
        ("FlashMLA D=576", 128, 576, 2048),
        ("H=16", 16, 576, 100),
    ],
)
def test_lowering_for_sm90a(name, H, D, K, monkeypatch):
    """The non-interpreted kernel goes through Mosaic GPU's whole lowering (layout inference,
    transfer planning, shared-memory allocation) for an H100 without a GPU. Mosaic refuses a
    kernel over sm_90a's 227 KB of shared memory there, and so does this test."""
    from tools.aot import lower_for_cuda

    smem = _smem_recorder(monkeypatch)
    T, S = 4096, 65536
    specs = [
        jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((S, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((T, K), jnp.int32),
        jax.ShapeDtypeStruct((H,), jnp.float32),
        jax.ShapeDtypeStruct((T,), jnp.int32),
    ]

    def layer(q, kv, idx, sink, topk_length):
        return M.sparse_attention_mosaic(q, kv, idx, D**-0.5, sink, topk_length)

    text = lower_for_cuda(layer, *specs).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
    assert len(calls) == 1, f"{name}: expected one Mosaic GPU kernel, found {len(calls)}"
    assert f"tensor<{T}x{max(H, 64)}x{D}xbf16>" in text  # q goes in unpadded for H >= 64
    assert smem and max(smem) <= M.SMEM_LIMIT, smem
    assert abs(max(smem) - M.smem_bytes(D)) <= 4096, (smem, M.smem_bytes(D))  # the docstring's table


# --- 3. wiring and bad inputs ----------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_backend_mosaic_through_sparse_attention():
    """backend="mosaic_gpu", interpret=True runs the interpreted kernel on CPU, eagerly and under
    jit, with the FlashMLA layouts (S, 1, D) / (T, 1, K) and a width that is not a multiple of the
    32-column block."""
    q, kv, idx, sink, tl = _flashmla_case(3, 2, 16, 512, 200, 100, [100, 57])
    q, kv = _bf16(q), _bf16(kv)
    kw = dict(backend="mosaic_gpu", interpret=True)
    assert dsv4_jax.resolve_backend("mosaic_gpu", q, interpret=True) == "mosaic_gpu"
    eager = dsv4_jax.sparse_attention(
        q, kv[:, None], jnp.asarray(idx)[:, None], 0.05, jnp.asarray(sink), jnp.asarray(tl), **kw
    )
    jitted = jax.jit(lambda *a: dsv4_jax.sparse_attention(*a[:3], 0.05, *a[3:], **kw))(
        q, kv, jnp.asarray(idx), jnp.asarray(sink), jnp.asarray(tl)
    )
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = tuple(np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in eager)
    _assert_within_bf16_bounds(got, _oracle(q, kv, idx, 0.05, sink, tl))


def test_auto_prefers_mosaic_on_hopper(fake_gpu):
    """With a (pretend) SM90 GPU and jax >= 0.12, "auto" runs the Mosaic kernel for the inputs it
    serves and Pallas-Triton for the others; "mosaic_gpu" on a GPU it cannot use raises."""
    q = jnp.zeros((2, 64, 512), jnp.bfloat16)
    assert dsv4_jax.resolve_backend("auto", q) == "mosaic_gpu"
    assert dsv4_jax.resolve_backend("mosaic_gpu", q) == "mosaic_gpu"
    assert dsv4_jax.resolve_backend("auto", q.astype(jnp.float32)) == "triton"
    assert dsv4_jax.resolve_backend("auto", jnp.zeros((2, 20, 512), jnp.bfloat16)) == "triton"
    assert dsv4_jax.resolve_backend("auto", jnp.zeros((2, 64, 64), jnp.bfloat16)) == "triton"
    fake_gpu.compute_capability = "10.0"  # a Blackwell GPU: not the kernel's
    assert dsv4_jax.resolve_backend("auto", q) == "triton"
    with pytest.raises(dsv4_jax.BackendUnavailableError, match="mosaic_gpu.*Hopper"):
        dsv4_jax.resolve_backend("mosaic_gpu", q)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=jnp.zeros((2, 48, 512), jnp.bfloat16)), "backend.'mosaic_gpu'.? serves .* heads, got H=48"),
        (
            dict(q=jnp.zeros((2, 64, 256), jnp.bfloat16), kv=jnp.zeros((8, 256), jnp.bfloat16)),
            "q: .* head dims .* got D=256",
        ),
        (
            dict(q=jnp.zeros((2, 64, 512), jnp.float32), kv=jnp.zeros((8, 512), jnp.float32)),
            "q: backend.'mosaic_gpu'.? takes bfloat16",
        ),
    ],
)
def test_inputs_the_kernel_does_not_serve(change, message):
    args = dict(
        q=jnp.zeros((2, 64, 512), jnp.bfloat16),
        kv=jnp.zeros((8, 512), jnp.bfloat16),
        indices=jnp.zeros((2, 32), jnp.int32),
        sm_scale=0.1,
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        M.sparse_attention_mosaic(**args, interpret=True)
    with pytest.raises((ValueError, TypeError), match=message):  # the public entry point says the same
        dsv4_jax.sparse_attention(**args, backend="mosaic_gpu", interpret=True)
