"""dsv4-prefill planner: chunk plans, workspace layouts, sparse indices and a float64 oracle.

Pure NumPy. Both framework packages (`dsv4_torch`, `dsv4_jax`) consume what it computes.
"""

from planner.batch import LayerKind, PrefillBatch, cdiv, layer_kind
from planner.plan import (
    ChunkLayout,
    KindPlan,
    PlanConfig,
    StepPlan,
    as_step_plan,
    get_fixed_chunk_plan,
    get_prefill_chunk_plan,
    plan_kind,
    plan_step,
)
from planner.layout import build_chunk_indices, check_topk_rows, chunk_gather_rows, gather_workspace, index_width
from planner import oracle

__all__ = [
    "ChunkLayout",
    "KindPlan",
    "LayerKind",
    "PlanConfig",
    "PrefillBatch",
    "StepPlan",
    "as_step_plan",
    "build_chunk_indices",
    "check_topk_rows",
    "cdiv",
    "chunk_gather_rows",
    "gather_workspace",
    "get_fixed_chunk_plan",
    "get_prefill_chunk_plan",
    "index_width",
    "layer_kind",
    "oracle",
    "plan_kind",
    "plan_step",
]
