"""dsv4-prefill planner: chunk plans, workspace layouts, sparse indices and a float64 oracle.

Pure NumPy. Both framework packages (`dsv4_torch`, `dsv4_jax`) consume what it computes. The
contract they share (kinds, names, constants, formulas, presets) is `planner.contract`.
"""

from planner import contract, cost, oracle, schedule, sizes
from planner.batch import BandRows, PrefillBatch
from planner.contract import (
    BANDS,
    POLICIES,
    PRESETS,
    V4_LAYERS,
    V41_PRESETS,
    BackendUnavailableError,
    LayerKind,
    LayerSpec,
    ModelShape,
    PlanKey,
    cdiv,
    layer_specs,
    replay_start_of_hit,
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
    band_local_plan,
    get_prefill_chunk_plan,
    plan_kind,
    plan_step,
)
from planner.schedule import LayerRole, Schedule

__all__ = [
    "BANDS",
    "BackendUnavailableError",
    "BandRows",
    "ChunkLayout",
    "KindPlan",
    "LayerKind",
    "LayerRole",
    "LayerSpec",
    "ModelShape",
    "POLICIES",
    "PRESETS",
    "PlanConfig",
    "PlanKey",
    "PrefillBatch",
    "Schedule",
    "StepPlan",
    "V41_PRESETS",
    "V4_LAYERS",
    "as_step_plan",
    "band_local_plan",
    "build_chunk_indices",
    "cdiv",
    "check_topk_rows",
    "chunk_gather_rows",
    "contract",
    "cost",
    "gather_workspace",
    "get_prefill_chunk_plan",
    "index_width",
    "layer_specs",
    "oracle",
    "plan_kind",
    "plan_step",
    "replay_start_of_hit",
    "schedule",
    "sizes",
]
