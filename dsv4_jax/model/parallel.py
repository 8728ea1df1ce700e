"""Where the model's weights live on a `jax.sharding.Mesh`: one mesh axis splits them all.

`DeepseekV4(..., mesh=mesh, axis="tp")` (and `load_checkpoint(..., mesh=, axis=)`) split the
weights over the `n` devices of mesh axis `axis` (other axes hold replicas). Two kinds of split:

Compute splits (tensor, expert and vocabulary parallelism; `COMPUTE_SPLIT`):

  role (param tree)            split on                         compute
  embed (V, hidden)            vocabulary rows                  local rows + psum (exact)
  head (V, hidden)             vocabulary rows                  logits split on V, argmax over all
  attn.wq_b (H*D, q_lora)      output = query heads             q split by head, as the attention's
  attn.sink (H,)               heads                            shard_map wants (no communication)
  attn.wo_a (G*o_lora, H*D/G)  output rows (a group per device  XLA inserts the transfers
                               when n divides G, as V4-Flash on 8)
  attn.wo_b (hidden, G*o_lora) input columns                    row-parallel: partial sums + all-reduce
  ffn.shared_w1, shared_w3     output (the shared expert's I)   column-parallel
  ffn.shared_w2                input (I)                        row-parallel + all-reduce
  ffn.w13, ffn.w2 (E, ...)     experts                          expert-parallel shard_map + psum

Storage splits (everything else: wq_a, wkv, compressors, indexer, router, mHC, norms, biases,
tid2eid): each array is split on its first dimension that n divides (kept whole if none does)
and all-gathered where a program uses it (`gather_for_use`, FSDP-style), so those layers compute
on whole weights exactly as on one device; the indexer's and the router's top-k see the very
same scores. The gathered copies of one layer are a few tens of MB for V4-Flash.

A compute-split quantized weight splits its data as above and its scale grid along with it when
the split falls on block boundaries (else the scale, 1/16384 of an FP8 weight, is whole on every
device). A compute split that does not divide raises ValueError naming the weight.

Meshes with Explicit axes (`jax.make_mesh`'s default) are used through an Auto copy of the same
devices and names: the model lets XLA place its intermediates.
"""

from __future__ import annotations

from collections import defaultdict

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4_jax.model.quant import QuantizedWeight

COMPUTE_SPLIT = {
    "embed": 0,
    "head": 0,
    "attn.wq_b": 0,
    "attn.sink": 0,
    "attn.wo_a": 0,
    "attn.wo_b": 1,
    "ffn.shared_w1": 0,
    "ffn.shared_w3": 0,
    "ffn.shared_w2": 1,
    "ffn.w13": 0,
    "ffn.w2": 0,
}


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
    for what, v in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("n_routed_experts", cfg.n_routed_experts),
        ("vocab_size", cfg.vocab_size),
    ):
        if v % n:
            raise ValueError(f"mesh: {what} = {v} does not split over the {n} devices of axis {axis!r}")


def spec(
    role: str,
    shape: tuple[int, ...],
    n: int,
    axis,
    block: tuple[int, int] | None = None,
    logical: tuple[int, ...] | None = None,
) -> P:
    """The PartitionSpec of one array of weight `role` over an axis of n devices (module docstring).

    For a quantized weight's scale pass its `block` and the weight's `logical` shape.
    """
    shape = tuple(shape)
    if n == 1:
        return P()
    d = COMPUTE_SPLIT.get(role)
    if d is None:  # storage split: the first dimension n divides
        d = next((i for i, s in enumerate(shape) if s % n == 0 and s > 0), None)
        return P() if d is None else P(*([None] * d + [axis]))
    if block is not None:  # the scale grid of a compute-split quantized weight
        lead = len(shape) - 2
        if d >= lead:
            b = block[d - lead]
            if logical[d] % n or (logical[d] // n) % b or shape[d] % n:
                return P()
        return P(*([None] * d + [axis]))
    if shape[d] % n:
        raise ValueError(f"mesh: weight {role} of shape {shape} does not split over {n} devices on dim {d}")
    return P(*([None] * d + [axis]))


def gather_for_use(params, mesh):
    """Inside a program: the storage-split arrays of `params` (a param (sub)tree) all-gathered
    (whole on every device), compute-split ones as they are. No-op without a mesh."""
    if mesh is None:
        return params
    whole = NamedSharding(mesh, P())

    def one(path, leaf):
        if role_of(path) in COMPUTE_SPLIT:
            return leaf
        return jax.lax.with_sharding_constraint(leaf, whole)

    return jax.tree_util.tree_map_with_path(one, params)


def sharding(mesh, axis, role, shape, block=None, logical=None):
    """Where an array of `role` goes: a NamedSharding on the mesh; None (the default device,
    uncommitted) without one."""
    if mesh is None:
        return None
    return NamedSharding(mesh, spec(role, tuple(shape), axis_size(mesh, axis), axis, block, logical))


def role_of(path) -> str:
    """The role of a param-tree path, from the root (`layers`, i, `attn`, `wq_b`) or inside a
    layer (`attn`, `wq_b`): "embed", "head", "attn.wq_b", "ffn.w13", "attn_norm", ..."""
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    keys = [k for k in keys if k not in ("data", "scale")]  # QuantizedWeight children (flattened)
    if keys and keys[0] == "layers":
        keys = keys[2:]
    keys = [k for k in keys if isinstance(k, str)]
    if not keys:
        return ""
    return keys[0] if len(keys) == 1 else f"{keys[0]}.{keys[1]}"


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


__all__ = [
    "COMPUTE_SPLIT",
    "gather_for_use",
    "axis_size",
    "check_divisible",
    "device_bytes",
    "place",
    "resolve_mesh",
    "role_of",
    "sharding",
    "spec",
    "weight_bytes",
]
