"""dsv4_jax.sparse_attention against the float64 oracle (planner.oracle.sparse_attention).

Both CPU-runnable backends ("xla" and the Pallas kernel in interpret mode) on the FlashMLA
contract's edge cases, jit-compatibility, bitwise determinism of the reference backend, bad
inputs, and the kernel's real GPU configuration lowered to Triton for CUDA without a GPU.
Shapes are small and reused so each backend compiles only a handful of times.
"""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
import dsv4_jax.kvcache
from dsv4_jax.kernels.triton.attention import ALTERNATIVE_TILINGS, default_tuning, sparse_attention_pallas
from dsv4_jax.kernels.xla.attention import sparse_attention_xla
from planner import oracle
from tools.aot import kernel_arg_specs, lower_for_cuda, triton_ir

BACKENDS = ["xla", "triton:interpret"]  # a backend, or backend:interpret (its kernel in Pallas' interpreter)
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
BF16_OUT_TOL = dict(rtol=3 / 128, atol=8e-4)  # FlashMLA's tolerance against an fp32 reference


def _kw(spec: str) -> dict:
    """backend= / interpret= of a test's backend spec ("xla", "triton:interpret")."""
    name, _, mode = spec.partition(":")
    return dict(backend=name, interpret=mode == "interpret")


@functools.cache
def _jitted(backend: str, sm_scale: float):
    return jax.jit(
        lambda q, kv, idx, sink, topk_length: dsv4_jax.sparse_attention(
            q, kv, idx, sm_scale, sink, topk_length, **_kw(backend)
        )
    )


def _run(backend, q, kv, idx, sm_scale, sink=None, topk_length=None):
    as_jax = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    out = _jitted(backend, float(sm_scale))(as_jax(q), as_jax(kv), as_jax(idx), as_jax(sink), as_jax(topk_length))
    return tuple(np.asarray(x) for x in out)


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def _assert_matches_oracle(got, q, kv, idx, sm_scale, sink=None, topk_length=None, out_tol=FP32_TOL):
    """Compare (out, max_logits, lse) with the float64 oracle on the same (rounded) inputs."""
    out, max_logits, lse = got
    ref_out, ref_max, ref_lse = oracle.sparse_attention(
        _f64(q), _f64(kv), np.asarray(idx), sm_scale, _f64(sink), topk_length
    )
    assert out.shape == ref_out.shape and max_logits.shape == ref_max.shape and lse.shape == ref_lse.shape
    assert max_logits.dtype == np.float32 and lse.dtype == np.float32
    if out_tol is BF16_OUT_TOL:
        # FlashMLA's rule: an element passes if its absolute OR its relative error is small.
        err = np.abs(out.astype(np.float64) - ref_out)
        ok = (err < out_tol["atol"]) | (err / (np.abs(ref_out) + 1e-6) < out_tol["rtol"])
        assert ok.all(), f"{(~ok).sum()} of {ok.size} outputs off; worst abs error {err.max():.2e}"
    else:
        np.testing.assert_allclose(out.astype(np.float64), ref_out, **out_tol)
    # Rows without a valid key: exactly -inf / +inf; elsewhere fp32 accuracy (fp32 accumulation).
    np.testing.assert_array_equal(np.isneginf(max_logits), np.isneginf(ref_max))
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(max_logits[finite], ref_max[finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def _case(seed, T=8, H=4, D=64, S=48, K=160, dtype=np.float32):
    """Random q/kv and index rows that mix every kind of invalid entry with duplicates.

    fp32: unit normal data (peaked softmax). bf16: FlashMLA's test data, normal / 10 plus a
    small offset; its tolerance is made for that (P is rounded to bf16 before P @ V)."""
    rng = np.random.default_rng(seed)
    spread, shift = (1.0, 0.0) if dtype == np.float32 else (0.1, (rng.random() - 0.5) / 10)
    q = (spread * rng.standard_normal((T, H, D)) + shift).astype(np.float32)
    kv = (spread * rng.standard_normal((S, D)) + shift).astype(np.float32)
    idx = rng.integers(0, S, (T, K))
    idx[:, ::7] = -1  # padding marker
    idx[:, 3::11] = rng.integers(-(10**6), -1, idx[:, 3::11].shape)  # other negatives
    idx[:, 5::13] = rng.integers(S, S + 1000, idx[:, 5::13].shape)  # past the workspace
    idx[:, 10:20] = idx[:, 0:10]  # duplicated keys count twice
    topk_length = rng.integers(K // 2, K + 1, T)
    topk_length[T // 2] = 5  # shorter than the valid prefix
    if T >= 8:
        idx[1] = -1  # a row with no valid key at all
        idx[2, :] = S + 3  # ... and one whose entries are all out of range
        topk_length[3] = 0  # nothing valid
        topk_length[5] = K + 50  # longer than the row
        topk_length[6] = -4  # negative: nothing valid
    sink = np.array([-np.inf, 0.0, 30.0, 0.7] + list(rng.standard_normal(max(H - 4, 0))), np.float32)[:H]
    q, kv = (jnp.asarray(x, dtype) for x in (q, kv))
    return q, kv, idx.astype(np.int32), sink, topk_length.astype(np.int32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_fp32(backend):
    q, kv, idx, sink, topk_length = _case(0)
    scale = 64**-0.5
    _assert_matches_oracle(_run(backend, q, kv, idx, scale, sink, topk_length), q, kv, idx, scale, sink, topk_length)
    # Without sink and topk_length (the all-columns default) on the same compiled shapes.
    _assert_matches_oracle(_run(backend, q, kv, idx, scale), q, kv, idx, scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sink_value", [-np.inf, 0.0, 30.0])
def test_uniform_sinks(backend, sink_value):
    q, kv, idx, _, topk_length = _case(1)
    sink = np.full((q.shape[1],), sink_value, np.float32)
    got = _run(backend, q, kv, idx, 0.125, sink, topk_length)
    _assert_matches_oracle(got, q, kv, idx, 0.125, sink, topk_length)
    if sink_value == 30.0:  # the sink dominates: output tiny but lse unchanged by the sink
        assert np.abs(got[0]).max() < 1e-6
        _, _, lse_no_sink = _run(backend, q, kv, idx, 0.125, None, topk_length)
        np.testing.assert_array_equal(got[2], lse_no_sink)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unreferenced_rows_may_hold_garbage(backend):
    """Workspace rows no valid index points at (uninitialised memory) never leak in, even as
    NaN and even row 0, which the kernels read in place of invalid entries."""
    q, kv, idx, sink, topk_length = _case(11)
    S = kv.shape[0]
    valid = (idx >= 0) & (idx < S) & (np.arange(idx.shape[1])[None, :] < topk_length[:, None])
    idx = np.where(valid & (idx == 0), 1, idx)  # keep row 0 unreferenced
    unused = np.setdiff1d(np.arange(S), idx[valid])
    assert 0 in unused and S - len(unused) > 10
    dirty = jnp.asarray(kv).at[unused].set(jnp.nan)
    got = _run(backend, q, dirty, idx, 0.125, sink, topk_length)
    assert all(not np.isnan(x).any() for x in got)
    _assert_matches_oracle(got, q, kv, idx, 0.125, sink, topk_length)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_valid_key_anywhere(backend):
    q, kv, idx, sink, topk_length = _case(2)
    out, max_logits, lse = _run(backend, q, kv, idx, 0.125, sink, np.zeros_like(topk_length))
    assert not np.any(out) and np.all(np.isneginf(max_logits)) and np.all(np.isposinf(lse))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_propagates_like_the_oracle(backend):
    """A NaN in one token's q head, or in a gathered KV row, gives NaN in exactly the rows the
    oracle gives NaN (out, max_logits and lse), not 0 / -inf / +inf; other rows are untouched."""
    q, kv, idx, sink, topk_length = _case(8, T=8, H=4, D=32, S=48, K=64)
    idx[1] = -1  # token 1 has no valid key: still 0 / -inf / +inf
    idx[4, 0], topk_length[4] = 7, max(topk_length[4], 1)  # token 4 reads row 7 ...
    idx[:, 1:][idx[:, 1:] == 7] = 8  # ... and no other token does
    q = jnp.asarray(q).at[0, 2, 5].set(jnp.nan)  # token 0, head 2
    kv = jnp.asarray(kv).at[7, 3].set(jnp.nan).at[40:].set(jnp.nan)  # row 7, and rows nobody reads
    idx = np.where((idx >= 40) & (idx < 48), 9, idx).astype(np.int32)
    got = _run(backend, q, kv, idx, 0.125, sink, topk_length)
    ref = oracle.sparse_attention(_f64(q), _f64(kv), idx, 0.125, _f64(sink), topk_length)
    nan_rows = np.zeros((8, 4), bool)
    nan_rows[0, 2] = True
    nan_rows[4, :] = True
    for name, g, r in zip(("out", "max_logits", "lse"), got, ref):
        np.testing.assert_array_equal(np.isnan(r).reshape(8, 4, -1).any(-1), nan_rows, err_msg=f"oracle {name}")
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r), err_msg=name)
    clean = ~nan_rows
    np.testing.assert_allclose(got[0][clean], ref[0][clean], **FP32_TOL)
    np.testing.assert_array_equal(np.isposinf(got[2]), np.isposinf(ref[2]))
    finite = np.isfinite(ref[2])
    np.testing.assert_allclose(got[2][finite], ref[2][finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1][finite], ref[1][finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [128, 100])  # a multiple of 128 and not
def test_index_widths(backend, width):
    q, kv, idx, sink, topk_length = _case(3, K=width)
    _assert_matches_oracle(_run(backend, q, kv, idx, 0.2, sink, topk_length), q, kv, idx, 0.2, sink, topk_length)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_within_flashmla_tolerance(backend):
    q, kv, idx, sink, topk_length = _case(4, dtype=jnp.bfloat16)
    got = _run(backend, q, kv, idx, 0.125, sink, topk_length)
    assert got[0].dtype == jnp.bfloat16
    _assert_matches_oracle(got, q, kv, idx, 0.125, sink, topk_length, out_tol=BF16_OUT_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_d576_value_dim_512(backend, dtype):
    """FlashMLA's D = 576: 512 value dims plus a 64-dim tail that only enters the scores."""
    q, kv, idx, sink, topk_length = _case(5, T=3, H=16, D=576, S=40, K=64, dtype=dtype)
    got = _run(backend, q, kv, idx, 576**-0.5, sink, topk_length)
    assert got[0].shape == (3, 16, 512) and got[0].dtype == dtype
    tol = FP32_TOL if dtype == np.float32 else BF16_OUT_TOL
    _assert_matches_oracle(got, q, kv, idx, 576**-0.5, sink, topk_length, out_tol=tol)


@pytest.mark.parametrize("D", [40, 520])  # non-power-of-two value dim; D > 512 with an odd tail
def test_general_head_dims_pallas(D):
    q, kv, idx, sink, topk_length = _case(6, T=2, H=3, D=D, S=20, K=32)
    got = _run("triton:interpret", q, kv, idx, 0.1, sink, topk_length)
    _assert_matches_oracle(got, q, kv, idx, 0.1, sink, topk_length)


@pytest.mark.parametrize(
    "tiling",
    [None, (16, 32, 256, 8, 3), (16, 16, 128, 4, 2)],
    ids=["gpu-default", "two-dv-programs", "four-dv-programs"],
)
def test_gpu_tiling_in_interpret_mode(tiling):
    """The tilings a GPU runs, checked for correctness on 20 heads (padded to 32) and D = 576:
    the default (whole d_v per program, 64-row steps) and d_v split over 2 or 4 programs (each
    gathers its own V slice first and scores with the pieces in rotated order)."""
    q, kv, idx, sink, topk_length = _case(7, T=3, H=20, D=576, S=40, K=80, dtype=jnp.bfloat16)
    if tiling is None:
        cfg = default_tuning(20, 576, interpret=False)
        assert cfg.block_dv == 512  # no score recomputation by default
        tiling = (cfg.block_h, cfg.block_k, cfg.block_dv, cfg.num_warps, cfg.num_stages)
    block_h, block_k, block_dv, num_warps, num_stages = tiling
    got = sparse_attention_pallas(
        q,
        kv,
        jnp.asarray(idx),
        576**-0.5,
        jnp.asarray(sink),
        jnp.asarray(topk_length),
        block_h=block_h,
        block_k=block_k,
        block_dv=block_dv,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=True,
    )
    got = tuple(np.asarray(x) for x in got)
    _assert_matches_oracle(got, q, kv, idx, 576**-0.5, sink, topk_length, out_tol=BF16_OUT_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flashmla_layouts_and_eager_call(backend):
    """kv (S, 1, D) and indices (T, 1, K), called eagerly (no outer jit)."""
    q, kv, idx, sink, topk_length = _case(0)
    got = dsv4_jax.sparse_attention(
        q,
        kv[:, None, :],
        jnp.asarray(idx)[:, None, :],
        64**-0.5,
        jnp.asarray(sink),
        jnp.asarray(topk_length),
        **_kw(backend),
    )
    _assert_matches_oracle(tuple(np.asarray(x) for x in got), q, kv, idx, 64**-0.5, sink, topk_length)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_shapes(backend):
    rng = np.random.default_rng(8)
    q = jnp.asarray(rng.standard_normal((3, 4, 16)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    out, max_logits, lse = dsv4_jax.sparse_attention(q, kv, jnp.zeros((3, 0), jnp.int32), 1.0, **_kw(backend))
    assert out.shape == (3, 4, 16) and not np.any(np.asarray(out)) and np.all(np.isposinf(np.asarray(lse)))
    out, max_logits, lse = dsv4_jax.sparse_attention(q[:0], kv, jnp.zeros((0, 8), jnp.int32), 1.0, **_kw(backend))
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)
    out, max_logits, lse = dsv4_jax.sparse_attention(q, kv[:0], jnp.zeros((3, 8), jnp.int32), 1.0, **_kw(backend))
    assert np.all(np.isneginf(np.asarray(max_logits)))


# --- Determinism of the reference backend -------------------------------------------------


def _xla(q, kv, idx, topk_length, sink, **tiling):
    out = sparse_attention_xla(q, kv, jnp.asarray(idx), 0.125, jnp.asarray(sink), jnp.asarray(topk_length), **tiling)
    return tuple(np.asarray(x) for x in out)


def _assert_bitwise(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)  # NaN-free; inf patterns included


def test_xla_token_tiling_invariance():
    """A token gets the same bits whichever tokens share its call, in any number and order
    (so however a plan splits tokens into chunks)."""
    q, kv, idx, sink, topk_length = _case(9, T=24)
    base = _xla(q, kv, idx, topk_length, sink)
    rng = np.random.default_rng(0)
    for count in (1, 11):
        pick = rng.permutation(24)[:count]
        _assert_bitwise(tuple(x[pick] for x in base), _xla(q[pick], kv, idx[pick], topk_length[pick], sink))


def test_xla_plan_invariance():
    """Same keys in the same columns of a wider row, at other workspace rows: same bits.
    This is what lets two chunk plans agree bitwise on the reference backend."""
    q, kv, idx, sink, topk_length = _case(10, T=6, K=128)
    base = _xla(q, kv, idx, topk_length, sink)
    S = kv.shape[0]
    rng = np.random.default_rng(1)
    offset, S2 = 37, 3 * S
    new_rows = offset + rng.permutation(S2 - offset)[:S]  # where each old row lands
    kv2 = jnp.asarray(rng.standard_normal((S2, kv.shape[1])), jnp.float32).at[new_rows].set(kv)
    valid = (idx >= 0) & (idx < S)
    idx2 = np.where(valid, new_rows[np.clip(idx, 0, S - 1)], -1)
    idx2 = np.concatenate([idx2, np.full((idx.shape[0], 256), -1)], axis=1).astype(np.int32)
    _assert_bitwise(base, _xla(q, kv2, idx2, topk_length, sink))


# --- Backend choice -----------------------------------------------------------------------


def test_backend_resolution_on_this_machine(caplog):
    available = dsv4_jax.available_backends()
    assert set(available) == {"xla", "cpu", "triton", "mosaic_gpu", "mosaic_tpu"}
    assert available["xla"] is None
    assert dsv4_jax.resolve_backend("triton", interpret=True) == "triton"  # Pallas' interpreter runs anywhere
    mosaic_interpret = dsv4_jax.backends.ATTENTION["mosaic_gpu"].interpret_unavailable()
    if mosaic_interpret is not None:  # jax < 0.12: the Mosaic GPU kernel says why, compiled or interpreted
        assert "jax >= 0.12" in mosaic_interpret and "jax >= 0.12" in available["mosaic_gpu"]
        with pytest.raises(dsv4_jax.BackendUnavailableError, match="mosaic_gpu.*jax >= 0.12"):
            dsv4_jax.resolve_backend("mosaic_gpu", interpret=True)
    elif jax.default_backend() == "cpu":
        assert dsv4_jax.resolve_backend("mosaic_gpu", interpret=True) == "mosaic_gpu"
        with pytest.raises(dsv4_jax.BackendUnavailableError, match="mosaic_gpu.*NVIDIA GPU.*interpret=True"):
            dsv4_jax.resolve_backend("mosaic_gpu")
    if jax.default_backend() == "cpu":
        assert "NVIDIA GPU" in available["triton"]
        assert "interpret=True" in available["mosaic_tpu"]  # compiles for TPU arrays only
        # the C kernel where it builds (tests/jax/test_cpu_attention.py), else the reference
        assert dsv4_jax.resolve_backend("auto") == ("cpu" if available["cpu"] is None else "xla")
        with pytest.raises(RuntimeError, match="triton.*NVIDIA GPU.*interpret=True runs it"):
            dsv4_jax.resolve_backend("triton")
    with pytest.raises(ValueError, match="backend"):
        dsv4_jax.resolve_backend("cuda")
    with pytest.raises(ValueError, match="interpret=True must name its backend"):
        dsv4_jax.resolve_backend("auto", interpret=True)
    with pytest.raises(dsv4_jax.BackendUnavailableError, match="xla.*no interpret mode"):
        dsv4_jax.resolve_backend("xla", interpret=True)
    q, kv, idx, _, _ = _case(0)
    with caplog.at_level(logging.DEBUG, logger="dsv4_jax"):
        dsv4_jax.sparse_attention(q, kv, jnp.asarray(idx), 0.125, backend="auto")
    expected = dsv4_jax.resolve_backend("auto")
    assert any(f"'auto' -> {expected}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "old, new",
    [
        ("pallas", "backend='triton'"),
        ("pallas_triton", "backend='triton'"),
        ("pallas_interpret", "backend='triton', interpret=True"),
        ("mosaic", "backend='mosaic_gpu'"),
        ("mosaic_interpret", "backend='mosaic_gpu', interpret=True"),
    ],
)
def test_renamed_backends_point_to_the_new_name(old, new):
    q, kv, idx, _, _ = _case(0)
    for call in (
        lambda: dsv4_jax.resolve_backend(old),
        lambda: dsv4_jax.sparse_attention(q, kv, jnp.asarray(idx), 0.125, backend=old),
        lambda: dsv4_jax.kvcache.resolve_backend(old),
    ):
        with pytest.raises(ValueError, match=f"backend={old!r} was renamed: use {re.escape(new)}"):
            call()


def test_backend_follows_committed_arrays(fake_gpu, caplog):
    """With a (pretend) capable GPU as the default device, arrays committed to the CPU still
    resolve "auto" to a CPU backend (the C kernel where it builds, else xla); uncommitted or
    traced arrays follow the default device."""
    cpu = jax.devices("cpu")[0]
    q, kv, idx, _, _ = _case(0, T=2)
    committed = [jax.device_put(x, cpu) for x in (q, kv, jnp.asarray(idx))]
    from dsv4_jax.kernels.mosaic_gpu import attention as mosaic

    # No q: the first GPU kernel this jax has (mosaic_gpu from jax 0.12 on an SM90); this q's
    # 4 heads of 64 are not mosaic_gpu's shapes, so it takes triton.
    assert dsv4_jax.resolve_backend("auto") == ("triton" if mosaic.unavailable_reason() else "mosaic_gpu")
    assert dsv4_jax.resolve_backend("auto", jnp.asarray(q)) == "triton"  # uncommitted
    on_cpu = "cpu" if dsv4_jax.available_backends(*committed)["cpu"] is None else "xla"
    assert dsv4_jax.resolve_backend("auto", *committed) == on_cpu
    assert dsv4_jax.resolve_backend("triton", *committed, interpret=True) == "triton"
    assert "NVIDIA GPU" in dsv4_jax.available_backends(*committed)["triton"]
    with pytest.raises(RuntimeError, match="triton.*NVIDIA GPU.*cpu"):
        dsv4_jax.resolve_backend("triton", committed[0])
    seen = []
    jax.jit(lambda x: seen.append(dsv4_jax.resolve_backend("auto", x)) or x)(committed[0])
    assert seen == ["triton"]  # traced: the caller's jit places it, default device rules
    with caplog.at_level(logging.DEBUG, logger="dsv4_jax"):
        got = dsv4_jax.sparse_attention(*committed, 0.125, backend="auto")
    assert any(f"'auto' -> {on_cpu}" in r.getMessage() for r in caplog.records)
    _assert_matches_oracle(tuple(np.asarray(x) for x in got), q, kv, idx, 0.125)


# --- Bad inputs ---------------------------------------------------------------------------


def _bad_input_cases():
    q = jnp.zeros((4, 2, 16), jnp.float32)
    kv = jnp.zeros((8, 16), jnp.float32)
    idx = jnp.zeros((4, 32), jnp.int32)
    return [
        (TypeError, "q:", dict(q=q.astype(jnp.int32))),
        (TypeError, "kv: dtype", dict(kv=kv.astype(jnp.bfloat16))),
        (ValueError, "q:", dict(q=q[0])),
        (ValueError, "kv: expected shape \\(S, 1, D\\)", dict(kv=jnp.zeros((8, 2, 16), jnp.float32))),
        (ValueError, "kv: last dim 12", dict(kv=jnp.zeros((8, 12), jnp.float32))),
        (TypeError, "indices: expected int32, got float32", dict(indices=idx.astype(jnp.float32))),
        (TypeError, "indices: expected int32, got int64", dict(indices=np.zeros((4, 32), np.int64))),
        (ValueError, "indices: 3 rows for 4", dict(indices=idx[:3])),
        (ValueError, "indices: expected shape \\(T, 1, K\\)", dict(indices=jnp.zeros((4, 2, 32), jnp.int32))),
        (ValueError, "attn_sink: expected shape \\(2,\\)", dict(attn_sink=jnp.zeros((3,), jnp.float32))),
        (TypeError, "attn_sink: expected a float", dict(attn_sink=jnp.zeros((2,), jnp.int32))),
        (ValueError, "topk_length: expected shape \\(4,\\)", dict(topk_length=jnp.zeros((5,), jnp.int32))),
        (TypeError, "topk_length: expected int32", dict(topk_length=jnp.zeros((4,), jnp.float32))),
        (ValueError, "sm_scale: must be finite", dict(sm_scale=float("inf"))),
        (TypeError, "sm_scale: expected a real number", dict(sm_scale="big")),
        (ValueError, "backend='pallas' was renamed", dict(backend="pallas")),
    ], dict(q=q, kv=kv, indices=idx, sm_scale=0.25)


@pytest.mark.parametrize("case", range(16))
def test_bad_inputs(case):
    cases, good = _bad_input_cases()
    error, message, change = cases[case]
    kwargs = {**good, **change}
    with pytest.raises(error, match=message):
        dsv4_jax.sparse_attention(**kwargs)


def test_bad_inputs_under_jit():
    """Shape errors surface at trace time; a traced sm_scale is refused with a clear message."""
    q = jnp.zeros((4, 2, 16), jnp.float32)
    kv = jnp.zeros((8, 16), jnp.float32)
    with pytest.raises(ValueError, match="indices: 3 rows"):
        jax.jit(lambda q, kv, i: dsv4_jax.sparse_attention(q, kv, i, 0.5))(q, kv, jnp.zeros((3, 8), jnp.int32))
    with pytest.raises(TypeError, match="sm_scale: must be a concrete"):
        jax.jit(lambda s: dsv4_jax.sparse_attention(q, kv, jnp.zeros((4, 8), jnp.int32), s))(0.5)


def test_bad_tiling():
    q, kv, idx = jnp.zeros((2, 2, 16)), jnp.zeros((4, 16)), jnp.zeros((2, 16), jnp.int32)
    with pytest.raises(ValueError, match="block_h: must be a power of two >= 16, got 24"):
        sparse_attention_pallas(q, kv, idx, 1.0, block_h=24, interpret=True)
    with pytest.raises(ValueError, match="block_dv: 64 exceeds"):
        sparse_attention_pallas(q, kv, idx, 1.0, block_dv=64, interpret=True)


# --- The real GPU configuration, lowered for CUDA on a CPU-only machine -------------------


@pytest.mark.parametrize(
    "name, H, D, K",
    [("V4-Flash", 64, 512, 640), ("V4-Pro", 128, 512, 1152), ("V4-Pro D=576", 128, 576, 1152)],
)
def test_triton_lowering_for_cuda(name, H, D, K):
    """Runs the Pallas -> Triton lowering with the tiling a GPU would use; catches Triton rule
    violations (non power-of-two blocks, unsupported ops) in CI rather than on a GPU."""
    T, S = 4096, 65536
    cfg = default_tuning(H, D, interpret=False)

    def prefill_layer(q, kv, idx, sink, topk_length):
        return sparse_attention_pallas(q, kv, idx, D**-0.5, sink, topk_length, interpret=False)

    text = lower_for_cuda(prefill_layer, *kernel_arg_specs(T, H, D, S, K)).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1, f"{name}: expected one Triton kernel, found {len(calls)}"
    call = calls[0]
    params = dict(re.findall(r"(grid_[xyz]|num_warps|num_stages) = (\d+)", call))
    assert int(params["num_warps"]) == cfg.num_warps and int(params["num_stages"]) == cfg.num_stages
    grid = sorted(int(params[k]) for k in ("grid_x", "grid_y", "grid_z"))
    assert grid == sorted([H // cfg.block_h, 512 // cfg.block_dv, T]), params
    # The serialized Triton module carries its op names: a gathered load and tensor-core dots.
    assert "\\00dot\\00" in call and "\\00load\\00" in call
    assert f"tensor<{T}x{H}x{D}xbf16>" in call  # q goes in unpadded: no copy on the fast path


@pytest.mark.parametrize("D", [512, 576])
def test_default_gpu_tiling_fits_hopper(D):
    """Compiles the Triton IR that Pallas emits with the triton wheel for sm_90a and checks what
    only a GPU would otherwise reveal: shared memory within Hopper's 227 KB and tensor-core
    (wgmma) dots. (The wheel's Triton is not jaxlib's, so this is a strong hint, not proof.)"""
    pytest.importorskip("triton")
    from tools.triton_compile import compile_ttir

    cfg = default_tuning(64, D, interpret=False)
    res = compile_ttir(triton_ir(4096, 64, D, 65536, 640, vars(cfg)), cfg.num_warps, cfg.num_stages, arch=90)
    assert res["ptxas_error"] is None, res
    assert res["shared_kb"] <= 227, res
    assert (res["wgmma"] or res["mma_sync"]) and res["cp_async"], res  # tensor-core dots, async copies
    assert res["spill_bytes"] is not None and res["spill_bytes"] <= 64, res  # 0 bytes with Triton 3.9
    assert cfg.block_dv == 512  # whole d_v per program: no score recomputation


@pytest.mark.parametrize("tiling", [t for t in ALTERNATIVE_TILINGS if t is not None])
def test_alternative_tilings_gather_each_kv_column_once(tiling):
    """Every GPU tiling lowers to Triton IR whose loop gathers each KV column of a step exactly
    once: with d_v split over programs, V comes from the gathered K pieces, not a second load."""
    block_h, block_k, block_dv, num_warps, num_stages = tiling
    cfg = dict(block_h=block_h, block_k=block_k, block_dv=block_dv, num_warps=num_warps, num_stages=num_stages)
    ir = triton_ir(64, 64, 576, 4096, 640, cfg)
    gathered = re.findall(rf"tt.load %\w+, %\w+, %\w+ : tensor<{block_k}x(\d+)x!tt.ptr<bf16>>", ir)
    assert sum(map(int, gathered)) == 576, gathered  # 512 value columns (in pieces) + the 64-dim tail
    assert all(int(w) in (block_dv, 64) for w in gathered), gathered
    assert "__nv_exp2f" in ir and "__nv_expf" in ir  # exp2 in the loop; exp once for the sink
