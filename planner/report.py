"""Readable tables of a step's plans: chunks, workspace and kernel launches, adaptive vs fixed."""

from __future__ import annotations

from planner.batch import PrefillBatch
from planner.config import PlanConfig
from planner.contract import LayerKind, ModelShape
from planner.plan import plan_step
from planner.schedule import Schedule

BYTES_PER_ROW = 512 * 2  # one bf16 latent of 512 dims

# A fresh-prompt batch for the V4.1 section: requests with more new rows than V4.1's window (128),
# so decoder bounded replay has rows to drop.
V41_SEQ_LENS = (2048, 900, 300, 130, 17)
V41_QUERY_LENS = (2048, 900, 300, 130, 17)

# The worked example of spec section 4.
SPEC_SEQ_LENS = (256, 320, 448, 640, 1024, 1536, 3072, 4096, 6144, 8192)
SPEC_QUERY_LENS = (4, 8, 8, 8, 16, 16, 32, 32, 32, 32)
SPEC_LIMITS = dict(window_size=64, max_model_len=16384, max_num_batched_tokens=4096, prefill_chunk_size=4)


def table(rows: list[list], header: list[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if c[:1].isdigit() or c[:1] == "-" else c.ljust(w) for c, w in zip(r, widths))
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def mib(rows: int) -> str:
    return f"{rows * BYTES_PER_ROW / 2**20:.2f}"


def saving(new: float, old: float) -> str:
    return f"{100 * (1 - new / old):.1f}%" if old else "-"


def plan_report(batch: PrefillBatch, limits: dict, policies=("adaptive", "fixed")) -> str:
    """The main job's planner section: one table per concern, for every layer kind."""
    steps = {pol: plan_step(batch, PlanConfig(policy=pol, **limits)) for pol in policies}
    out = [
        f"{batch.num_requests} prefill requests, {batch.num_tokens} query tokens; "
        + ", ".join(f"{k}={v}" for k, v in limits.items())
    ]
    rows = []
    for kind in LayerKind:
        for pol in policies:
            kp = steps[pol][kind]
            tuples = kp.as_tuples() if kp.config.order == "batch" and not kp.split_requests.size else []
            shown = " ".join(f"({s},{e},{n},{m})" for s, e, n, m in tuples[:4]) + (" ..." if len(tuples) > 4 else "")
            rows.append(
                [
                    kind.name,
                    kp.compress_ratio,
                    pol,
                    kp.num_chunks,
                    shown,
                    kp.max_workspace_rows,
                    mib(kp.max_workspace_rows),
                    kp.total_workspace_rows,
                    kp.padding_free_rows,
                ]
            )
    out += [
        "",
        "Chunk plans and workspace (bf16, 512-d rows; peak = the one buffer every chunk reuses):",
        table(
            rows,
            [
                "kind",
                "r",
                "plan",
                "chunks",
                "(start,end,N,M)",
                "peak rows",
                "peak MiB",
                "rows, all chunks",
                "padding-free rows",
            ],
        ),
    ]
    if "adaptive" in steps and "fixed" in steps:
        rows = []
        for kind in LayerKind:
            a, f = steps["adaptive"][kind], steps["fixed"][kind]
            rows.append(
                [
                    kind.name,
                    a.num_chunks,
                    f.num_chunks,
                    mib(a.max_workspace_rows),
                    mib(f.max_workspace_rows),
                    saving(a.max_workspace_rows, f.max_workspace_rows),
                ]
            )
        out += [
            "",
            "Adaptive vs fixed, per layer of each kind:",
            table(
                rows,
                ["kind", "adaptive chunks", "fixed chunks", "adaptive peak MiB", "fixed peak MiB", "workspace saved"],
            ),
        ]
        rows = []
        for shape in (ModelShape.from_name("V4-Flash"), ModelShape.from_name("V4-Pro")):
            layers = shape.layers_per_kind()
            launches = {
                pol: sum(steps[pol][k].num_chunks * n for k, n in layers.items()) for pol in ("adaptive", "fixed")
            }
            rows.append(
                [
                    shape.name,
                    "/".join(str(layers[k]) for k in LayerKind),
                    launches["adaptive"],
                    launches["fixed"],
                    saving(launches["adaptive"], launches["fixed"]),
                ]
            )
        out += [
            "",
            "Sparse-attention kernel launches per prefill step (chunks x layers, MTP layer included):",
            table(rows, ["model", "layers SWA/CSA/HCA", "adaptive", "fixed", "saved"]),
        ]
    return "\n".join(out)


def v41_report(batch: PrefillBatch, limits: dict, schedule: Schedule | None = None) -> str:
    """A DeepSeek-V4.1 step's plans for `batch`: how many against vLLM's one call per attention
    layer, which layers share each, their chunks and workspace, and the rows each band computes,
    with decoder bounded replay on and off. `limits` as `plan_report` takes them; the window is
    the schedule's own (`sliding_window`, 128 in the released model)."""
    sched = schedule if schedule is not None else Schedule.from_name("V4.1")
    lim = {**limits, "window_size": sched.sliding_window}
    out = [
        f"DeepSeek-V4.1 ({sched.num_layers} layers, ratios 0/2/1, KV sources {list(sched.kv_source_layer_ids)}): "
        f"{batch.num_requests} prefill requests, {batch.num_tokens} query tokens, window {sched.sliding_window}"
    ]
    rows, num_plans = [], {}
    for replay in (False, True):
        step = plan_step(batch, PlanConfig(replay=replay and sched.can_replay, **lim), sched)
        num_plans[replay] = step.num_plans
        computed = {b: int(r.query_lens.sum()) for b, r in step.bands.items()}
        for key, kp in step.plans.items():
            layers = step.sharing[key]
            rows.append(
                [
                    "on" if replay else "off",
                    key.compress_ratio,
                    key.band,
                    f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0]),
                    len(layers),
                    kp.num_chunks,
                    kp.max_workspace_rows,
                    mib(kp.max_workspace_rows),
                    computed[key.band],
                ]
            )
        rows.append(["", "", "", "", "", "", "", "", ""])
        if replay and not step.replay:
            why = sched.replay_off_reason or f"no request has more than {sched.sliding_window} new rows"
            out.append(f"(replay requested, not applied: {why})")
    rows.pop()
    out += [
        "",
        f"Plans per step: {num_plans[False]} without replay, {num_plans[True]} with it, against vLLM's {sched.num_layers} planner calls "
        "(one per attention layer, each recomputed):",
        table(
            rows,
            ["replay", "r", "band", "layers", "n", "chunks", "peak rows", "peak MiB", "rows computed"],
        ),
    ]
    return "\n".join(out)
