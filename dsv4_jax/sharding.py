"""Head-sharded sparse attention for more than one device.

Query heads are independent given the shared (MQA) workspace, so the natural split is by head:
each device gets `H / n` heads of q and of the sink, the whole workspace and index rows, and
produces its heads' outputs. No communication inside the op. The Pallas kernel has no SPMD
partitioning rule of its own, hence the explicit `shard_map`.

Meshes with Explicit axes (what `jax.make_mesh` builds by default since jax 0.10) make
`shard_map` check that each input's sharding type already equals its in_spec; inputs are
therefore resharded to the specs first (a no-op for inputs already placed that way). Meshes
with Auto axes need no such step: the partitioner inserts the transfers.
"""

from __future__ import annotations

import inspect

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4_jax.attention import check_inputs, sparse_attention

try:  # jax >= 0.7
    _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

# The replication/varying-axes check is called check_vma in jax.shard_map, check_rep before.
# It cannot see through pallas_call, so it is switched off.
_NO_CHECK = {"check_vma": False} if "check_vma" in inspect.signature(_shard_map).parameters else {"check_rep": False}


def _has_explicit_axes(mesh: Mesh) -> bool:
    axis_types = getattr(mesh, "axis_types", None) or ()
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return explicit is not None and any(t == explicit for t in axis_types)


def _place(x, mesh: Mesh, spec: P):
    """x resharded to `spec` on `mesh` (traced or concrete): what Explicit axes demand."""
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def sparse_attention_head_sharded(
    q,
    kv,
    indices,
    sm_scale,
    attn_sink=None,
    topk_length=None,
    *,
    mesh: Mesh,
    axis_name: str | None = None,
    backend: str = "auto",
    interpret=False,
):
    """`dsv4_jax.sparse_attention` with heads split over one mesh axis.

    Each device runs the single-device kernel on its H / n heads. The Pallas kernel pads a
    device's heads to at least 16 (Triton's smallest dot), so head sharding pays only while
    H / n >= 16: H = 64 on 8 devices runs 8 real heads in 16-row blocks on each device, half
    the MMA work wasted, and no faster per device than H = 128 on 8 devices.
    Works with Auto and Explicit mesh axes (`jax.make_mesh` defaults to Explicit); inputs not
    yet placed on the mesh are resharded to the specs below. Other mesh axes see replicas.

    Args:
      q: (T, H, D): sharded on H over `axis_name`; H must be a multiple of the axis size
        (ValueError otherwise).
      kv: (S, D) or (S, 1, D): replicated.
      indices: (T, K) or (T, 1, K) int32: replicated.
      sm_scale: float, a compile-time constant.
      attn_sink: (H,) float32 or None: sharded on H like q.
      topk_length: (T,) int32 or None: replicated.
      mesh: the device mesh.
      axis_name: the mesh axis that splits heads; may be omitted for a one-axis mesh.
      backend, interpret: as in `dsv4_jax.sparse_attention`, chosen per device.

    Returns:
      (out (T, H, d_v), max_logits (T, H), lse (T, H)), sharded on H over `axis_name`.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"axis_name: required for a mesh with axes {mesh.axis_names}")
        axis_name = mesh.axis_names[0]
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name: {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    q, kv, indices, sm_scale, attn_sink, topk_length = check_inputs(q, kv, indices, sm_scale, attn_sink, topk_length)
    num_heads, shards = q.shape[1], mesh.shape[axis_name]
    if num_heads % shards:
        raise ValueError(f"q: {num_heads} heads do not split evenly over the {shards} devices of axis {axis_name!r}")

    heads = P(None, axis_name)
    args, specs = [q, kv, indices], [P(None, axis_name, None), P(), P()]
    if attn_sink is not None:
        args.append(attn_sink)
        specs.append(P(axis_name))
    if topk_length is not None:
        args.append(topk_length)
        specs.append(P())

    if _has_explicit_axes(mesh):
        args = [_place(x, mesh, spec) for x, spec in zip(args, specs)]

    def per_device(q, kv, indices, *optional):
        optional = list(optional)
        sink = optional.pop(0) if attn_sink is not None else None
        lengths = optional.pop(0) if topk_length is not None else None
        return sparse_attention(q, kv, indices, sm_scale, sink, lengths, backend=backend, interpret=interpret)

    sharded = _shard_map(
        per_device,
        mesh=mesh,
        in_specs=tuple(specs),
        out_specs=(P(None, axis_name, None), heads, heads),
        **_NO_CHECK,
    )
    return sharded(*args)
