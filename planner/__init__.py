"""dsv4-prefill planner: chunk plans, workspace layouts, sparse indices and a float64 oracle.

Pure NumPy. Both framework packages (`dsv4_torch`, `dsv4_jax`) consume what it computes. The
contract they share (kinds, names, constants, formulas, presets) is `planner.contract`.
"""

from planner import contract, oracle, sizes
from planner.batch import PrefillBatch
from planner.contract import (
    POLICIES,
    PRESETS,
    V4_LAYERS,
    BackendUnavailableError,
    LayerKind,
    LayerSpec,
    ModelShape,
    cdiv,
    layer_specs,
)
from planner.kind_plan import ChunkLayout, KindPlan
from planner.layout import (
    build_chunk_indices,
    check_topk_rows,
    chunk_gather_rows,
    gather_workspace,
    index_width,
)
from planner.plan import (
    PlanConfig,
    StepPlan,
    as_step_plan,
    get_prefill_chunk_plan,
    plan_kind,
    plan_step,
)

__all__ = [
    "BackendUnavailableError",
    "ChunkLayout",
    "KindPlan",
    "LayerKind",
    "LayerSpec",
    "ModelShape",
    "POLICIES",
    "PRESETS",
    "PlanConfig",
    "PrefillBatch",
    "StepPlan",
    "V4_LAYERS",
    "as_step_plan",
    "build_chunk_indices",
    "cdiv",
    "check_topk_rows",
    "chunk_gather_rows",
    "contract",
    "gather_workspace",
    "get_prefill_chunk_plan",
    "index_width",
    "layer_specs",
    "oracle",
    "plan_kind",
    "plan_step",
    "sizes",
]
