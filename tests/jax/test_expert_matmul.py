"""The routed experts' grouped matmul: "ragged_dot" (`lax.ragged_dot_general`) and "dense_tiles"
(a loop of one-expert row tiles, the CPU default) against a float64 product, and inside both
models' MoE (`dsv4_jax.model.layers.moe`, `dsv4_jax.model.v41_blocks.moe_v41`)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from dsv4_jax.model import layers as L  # noqa: E402


def _want(x, w, sizes):
    out = np.zeros((x.shape[0], w.shape[1]))
    at = 0
    for g, n in enumerate(sizes):
        out[at : at + n] = x[at : at + n].astype(np.float64) @ w[g].astype(np.float64).T
        at += n
    return out  # rows past sum(sizes): zeros


@pytest.mark.parametrize(
    "sizes",
    [
        [0, 5, 0, 130, 1, 0, 256, 7],  # empty groups, a group of exactly 2 tiles, partial tiles
        [1, 0, 0, 2],  # decode-sized: a tile of 8 rows
        [0, 0, 0, 0],  # nothing routed here
        [300],
    ],
)
def test_dense_tiles_equal_ragged_dot_and_float64(sizes):
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    g, m = len(sizes), sum(sizes) + 3  # 3 rows past the groups (other devices' pairs)
    x = rng.standard_normal((m, 96)).astype(np.float32)
    w = rng.standard_normal((g, 40, 96)).astype(np.float32)
    s = jnp.asarray(sizes, jnp.int32)
    want = _want(x, w, sizes)
    got = {
        meth: np.asarray(jax.jit(L._grouped, static_argnums=3)(x, w, s, meth)) for meth in ("ragged_dot", "dense_tiles")
    }
    for meth, y in got.items():
        assert y.dtype == np.float32 and y.shape == want.shape
        assert np.abs(y - want).max() < 1e-4 * max(1.0, np.abs(want).max()), meth
        assert (y[sum(sizes) :] == 0).all(), meth
    assert np.abs(got["ragged_dot"] - got["dense_tiles"]).max() < 1e-5 * max(1.0, np.abs(want).max())


def test_names_resolve_per_platform_and_bad_names_raise():
    assert L.resolve_expert_matmul("auto", "cpu") == "dense_tiles"
    assert L.resolve_expert_matmul("auto", "gpu") == "ragged_dot"
    assert L.resolve_expert_matmul("auto", "tpu") == "ragged_dot"
    assert L.resolve_expert_matmul("ragged_dot", "cpu") == "ragged_dot"
    with pytest.raises(ValueError, match="expert_matmul: expected one of"):
        L.resolve_expert_matmul("tiles")
    with pytest.raises(ValueError, match="expert_matmul"):
        L._grouped(jnp.ones((2, 4)), jnp.ones((1, 3, 4)), jnp.asarray([2], jnp.int32), "auto")


def _moe_params(rng, E, hid, inter):
    w13 = rng.standard_normal((E, 2 * inter, hid)).astype(np.float32) * hid**-0.5
    w2 = rng.standard_normal((E, hid, inter)).astype(np.float32) * inter**-0.5
    p = {
        "gate": jnp.asarray(rng.standard_normal((E, hid)).astype(np.float32) * hid**-0.5),
        "bias": jnp.asarray(0.1 * rng.standard_normal(E).astype(np.float32)),
        "w13": jnp.asarray(w13),
        "w2": jnp.asarray(w2),
        "shared_w1": jnp.asarray(rng.standard_normal((inter, hid)).astype(np.float32) * hid**-0.5),
        "shared_w3": jnp.asarray(rng.standard_normal((inter, hid)).astype(np.float32) * hid**-0.5),
        "shared_w2": jnp.asarray(rng.standard_normal((hid, inter)).astype(np.float32) * inter**-0.5),
    }
    return p


@pytest.mark.parametrize("model", ["v4", "v4.1"])
def test_both_models_moe_equal_under_both_lowerings(model):
    from types import SimpleNamespace

    from dsv4_jax.model.v41_blocks import moe_v41

    rng = np.random.default_rng(7)
    E, hid, inter, T = 8, 256, 128, 37
    p = _moe_params(rng, E, hid, inter)
    x = jnp.asarray(rng.standard_normal((T, hid)).astype(np.float32))
    common = dict(num_experts_per_tok=3, swiglu_limit=10.0, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus")
    out = {}
    for meth in ("ragged_dot", "dense_tiles"):
        if model == "v4":
            cfg = SimpleNamespace(**common)
            hash_experts = jnp.zeros((T, 3), jnp.int32)
            f = jax.jit(lambda p, x: L.moe(p, x, hash_experts, False, cfg, expert_matmul=meth))  # noqa: B023
        else:
            cfg = SimpleNamespace(**common, gate_temp=1.0, norm_topk_prob=True)
            f = jax.jit(lambda p, x: moe_v41(p, x, cfg, expert_matmul=meth))  # noqa: B023
        out[meth] = np.asarray(f(p, x))
    assert np.abs(out["ragged_dot"]).max() > 0.1
    assert np.abs(out["ragged_dot"] - out["dense_tiles"]).max() < 1e-5
