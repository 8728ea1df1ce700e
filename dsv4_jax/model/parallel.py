"""Where the model's weights live on a `jax.sharding.Mesh`: one mesh axis splits them all.

`DeepseekV4(..., mesh=mesh, axis="tp")` (and `load_checkpoint(..., mesh=, axis=)`) split the
weights over the `n` devices of mesh axis `axis` (other axes hold replicas) as a tensor-, expert-
and vocabulary-parallel model does:

  role (param tree)          split on                          compute
  embed (V, hidden)          vocabulary rows                   local rows + psum (exact)
  head (V, hidden)           vocabulary rows                   logits split on V, argmax over all
  attn.wq_b (H*D, q_lora)    output = query heads              q split by head: the attention's own
  attn.sink (H,)             heads                             shard_map (no communication)
  attn.wo_a (G*o_lora, H*D/G) output rows (groups when n | G)   XLA inserts the transfers
  attn.wo_b (hidden, G*o_lora) input columns (row-parallel)    partial sums + all-reduce
  ffn.shared_w1, shared_w3   output (the shared expert's I)    column-parallel
  ffn.shared_w2              input (I)                         row-parallel + all-reduce
  ffn.w13, ffn.w2 (E, ...)   experts                           expert-parallel shard_map + psum
  everything else            replicated                        (wq_a, wkv, compressors, indexer,
                                                                router, mHC, norms: < 1% of V4-Flash)

A quantized weight splits its data the same way; its scale grid splits along when the split
falls on block boundaries, else it is replicated (scales are 1/16384 of an FP8 weight). A split
that does not divide raises ValueError naming the weight. The indexer and the router stay
replicated on purpose: their top-k must see the one-device scores bit for bit.

Meshes with Explicit axes (`jax.make_mesh`'s default) are used through an Auto copy of the same
devices and names: the model lets XLA place its intermediates.
"""

from __future__ import annotations

from collections import defaultdict

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsv4_jax.model.quant import QuantizedWeight

SPLIT_DIM = {
    "embed": 0, "head": 0,
    "attn.wq_b": 0, "attn.sink": 0, "attn.wo_a": 0, "attn.wo_b": 1,
    "ffn.shared_w1": 0, "ffn.shared_w3": 0, "ffn.shared_w2": 1,
    "ffn.w13": 0, "ffn.w2": 0,
}  # fmt: skip


def resolve_mesh(mesh, axis):
    """(Auto-axes mesh, axis name) for a user's mesh and axis (None: the mesh's first axis)."""
    if mesh is None:
        if axis is not None:
            raise ValueError(f"axis: {axis!r} given without a mesh")
        return None, None
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    axis = mesh.axis_names[0] if axis is None else axis
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of the mesh {mesh.axis_names}")
    auto = getattr(jax.sharding, "AxisType", None)
    types = getattr(mesh, "axis_types", None)
    if auto is not None and types is not None and any(t != auto.Auto for t in types):
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(auto.Auto,) * len(mesh.axis_names))
    return mesh, axis


def axis_size(mesh, axis) -> int:
    return 1 if mesh is None else int(mesh.shape[axis])


def check_divisible(cfg, mesh, axis) -> None:
    """ValueError unless heads, experts and vocabulary split evenly over the mesh axis."""
    n = axis_size(mesh, axis)
    for what, v in (("num_attention_heads", cfg.num_attention_heads), ("n_routed_experts", cfg.n_routed_experts),
                    ("vocab_size", cfg.vocab_size)):  # fmt: skip
        if v % n:
            raise ValueError(f"mesh: {what} = {v} does not split over the {n} devices of axis {axis!r}")


def spec(role: str, shape: tuple[int, ...], n: int, axis, block: tuple[int, int] | None = None,
         logical: tuple[int, ...] | None = None) -> P:  # fmt: skip
    """The PartitionSpec of one array of weight `role` (SPLIT_DIM) over an axis of n devices.

    For a quantized weight's scale pass its `block` and the weight's `logical` shape: the scale
    splits only where the weight's split falls on block boundaries (else replicated).
    """
    d = SPLIT_DIM.get(role)
    if n == 1 or d is None:
        return P()
    ndim = len(shape)
    if block is not None:  # a scale grid
        lead = ndim - 2
        if d >= lead:
            b = block[d - lead]
            if logical[d] % n or (logical[d] // n) % b or shape[d] % n:
                return P()
        return P(*([None] * d + [axis]))
    if shape[d] % n:
        raise ValueError(f"mesh: weight {role} of shape {shape} does not split over {n} devices on dim {d}")
    return P(*([None] * d + [axis]))


def sharding(mesh, axis, role, shape, block=None, logical=None):
    """Where an array of `role` goes: a NamedSharding on the mesh, or device 0 without one."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, spec(role, tuple(shape), axis_size(mesh, axis), axis, block, logical))


def role_of(path) -> str:
    """The SPLIT_DIM role of a param-tree path: "embed", "head", "attn.wq_b", "ffn.w13", ..."""
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if keys and keys[0] == "layers" and len(keys) >= 4:
        return f"{keys[2]}.{keys[3]}"
    return str(keys[0]) if keys else ""


def place(params, mesh, axis):
    """`params` (any placement) moved to where this module says they go on `mesh` (no copy for
    arrays already there)."""
    n = axis_size(mesh, axis)

    def one(path, leaf):
        role = role_of(path)
        if isinstance(leaf, QuantizedWeight):
            data = jax.device_put(leaf.data, NamedSharding(mesh, spec(role, leaf.data.shape, n, axis)))
            s = spec(role, leaf.scale.shape, n, axis, leaf.block, leaf.shape)
            return QuantizedWeight(data, jax.device_put(leaf.scale, NamedSharding(mesh, s)), leaf.fmt, leaf.block)
        return jax.device_put(leaf, NamedSharding(mesh, spec(role, np.shape(leaf), n, axis)))

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def device_bytes(tree) -> dict:
    """Bytes each device holds of the arrays in `tree` (QuantizedWeight: data + scale)."""
    out: dict = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for s in leaf.addressable_shards:
                out[s.device] += int(s.data.nbytes)
    return dict(out)


def weight_bytes(tree) -> int:
    """Total (logical, unreplicated) bytes of the arrays in `tree`."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree) if hasattr(leaf, "nbytes")))


def split_fraction(shapes: dict, n: int) -> float:
    """Bytes one device holds / all bytes, for {role: [(shape, itemsize), ...]} under SPLIT_DIM
    (shape-only: the V4-Flash figure needs no arrays)."""
    total = held = 0
    for role, items in shapes.items():
        for shape, itemsize in items:
            b = int(np.prod(shape)) * itemsize
            total += b
            held += b // n if SPLIT_DIM.get(role) is not None else b
    return held / total


__all__ = ["SPLIT_DIM", "axis_size", "check_divisible", "device_bytes", "place", "resolve_mesh", "role_of",
           "sharding", "spec", "split_fraction", "weight_bytes"]
