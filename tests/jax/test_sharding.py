"""Head-sharded sparse attention on 8 simulated CPU devices equals the single-device result.

The device count is fixed when JAX initialises, so the check runs in a fresh interpreter with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (it would otherwise clash with the JAX
already started by other tests in this process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECK = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dsv4_jax
    from dsv4_jax.sharding import sparse_attention_head_sharded

    assert jax.device_count() == 8, jax.devices()
    auto_mesh = jax.make_mesh((8,), ("heads",), axis_types=(jax.sharding.AxisType.Auto,))
    default_mesh = jax.make_mesh((8,), ("heads",))  # Explicit axes on jax >= 0.10
    assert default_mesh.axis_types == (jax.sharding.AxisType.Explicit,), default_mesh.axis_types
    rng = np.random.default_rng(0)
    T, H, D, S, K = 6, 16, 64, 40, 96
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((S, 1, D)), jnp.float32)
    idx = rng.integers(-2, S + 2, (T, K)).astype(np.int32)
    idx[1] = -1
    idx = jnp.asarray(idx)
    sink = jnp.asarray(np.r_[-np.inf, 30.0, rng.standard_normal(H - 2)], jnp.float32)
    topk_length = jnp.asarray(rng.integers(0, K + 1, T), jnp.int32)

    def assert_same(single, sharded):
        for a, b in zip(single, sharded):
            a, b = np.asarray(a), np.asarray(b)
            np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
            np.testing.assert_allclose(np.where(np.isinf(a), 0, a), np.where(np.isinf(b), 0, b), rtol=1e-6, atol=1e-7)
        return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(single, sharded))

    for mesh_name, mesh in (("auto", auto_mesh), ("explicit", default_mesh)):
        by_heads = NamedSharding(mesh, P(None, "heads", None))
        for backend, interpret in (("xla", False), ("triton", True)):
            single = dsv4_jax.sparse_attention(
                q, kv, idx, 0.125, sink, topk_length, backend=backend, interpret=interpret
            )
            # Jitted, inputs not placed on the mesh (single-device arrays).
            run = jax.jit(lambda q, kv, idx, sink, tl: sparse_attention_head_sharded(
                q, kv, idx, 0.125, sink, tl, mesh=mesh, backend=backend, interpret=interpret))
            sharded = run(q, kv, idx, sink, topk_length)
            assert sharded[0].sharding.is_equivalent_to(by_heads, 3), sharded[0].sharding
            bitwise = assert_same(single, sharded)
            # Eager, the same unplaced inputs.
            eager = sparse_attention_head_sharded(
                q, kv, idx, 0.125, sink, topk_length, mesh=mesh, backend=backend, interpret=interpret
            )
            assert eager[0].sharding.is_equivalent_to(by_heads, 3), eager[0].sharding
            assert_same(single, eager)
            # No sink / no lengths; q already placed by heads, kv placed replicated on the mesh.
            q_sharded = jax.device_put(q, by_heads)
            kv_placed = jax.device_put(kv, NamedSharding(mesh, P()))
            plain = sparse_attention_head_sharded(
                q_sharded, kv_placed, idx, 0.125, mesh=mesh, backend=backend, interpret=interpret
            )
            ref = dsv4_jax.sparse_attention(q, kv, idx, 0.125, backend=backend, interpret=interpret)
            np.testing.assert_allclose(np.asarray(plain[0]), np.asarray(ref[0]), rtol=1e-6, atol=1e-7)
            print(mesh_name, backend, "bitwise" if bitwise else "close")

    mesh = default_mesh
    try:
        sparse_attention_head_sharded(q[:, :12], kv, idx, 0.125, mesh=mesh)
    except ValueError as e:
        assert "12 heads do not split evenly over the 8 devices" in str(e), e
    else:
        raise AssertionError("12 heads on 8 devices must be refused")
    print("OK")
    """
)


def test_head_sharded_equals_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK"), result.stdout
    print(result.stdout)  # says whether the shards matched bit for bit (shown with -s)


def test_bad_mesh_arguments():
    import jax
    import jax.numpy as jnp

    from dsv4_jax.sharding import sparse_attention_head_sharded

    q, kv, idx = jnp.zeros((2, 4, 16)), jnp.zeros((3, 16)), jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(TypeError, match="mesh: expected a jax.sharding.Mesh"):
        sparse_attention_head_sharded(q, kv, idx, 1.0, mesh="heads")
    mesh = jax.make_mesh((1,), ("heads",))
    with pytest.raises(ValueError, match="axis_name: 'model' is not an axis"):
        sparse_attention_head_sharded(q, kv, idx, 1.0, mesh=mesh, axis_name="model")
