"""dsv4-prefill planner: chunk plans, workspace layouts, sparse indices and a float64 oracle.

Pure NumPy. Both framework packages (`dsv4_torch`, `dsv4_jax`) consume what it computes.
"""

from planner.batch import LayerKind, PrefillBatch, cdiv, layer_kind
from planner import oracle

__all__ = ["LayerKind", "PrefillBatch", "cdiv", "layer_kind", "oracle"]
