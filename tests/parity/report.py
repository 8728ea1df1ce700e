"""Parity report: every parity case on every backend this machine has, as a table and as JSON.

    python -m tests.parity.report [--json out/parity.json] [--quick] [--levels kernel,prefill,hf]
                                  [--match TEXT]

Tables: rows = case classes (kernel: class · dtype; prefill and transformers: class · layer kind
· dtype), columns = backend pairs, cells = max |a-b| / (max |a-b| / max |oracle|) and ok or FAIL
under the tolerance table (`tests/parity/tolerances.py`). A prefill table of plan invariance
follows (max difference across plans and cache layouts; bitwise required on the reference
backends in fp32), then the backends that did not run and why. On a GPU machine FlashMLA and
Pallas -> Triton join automatically. Exit status 1 if any row fails.

--quick: fp32 kernel rows, the tiny fp32 prefill family (V4 and V4.1) and the float64 transformers rows only.

DeepSeek-V4.1 rows (`tests/parity/v41.py`): "V4.1 ... · r<ratio> [cut|replay] · dtype", one per
plan key of a V4.1 step, each holding every layer of the tiny schedule that reads that plan.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import tests.parity  # noqa: F401  (TRITON_INTERPRET before any kernel import)
from tests.parity import backends as B
from tests.parity import cases as C
from tests.parity import harness as H
from tests.parity.tolerances import TABLE

LEVELS = ("kernel", "prefill", "hf")
QUICK_FAMILY = "tiny-fp32"
SHORT = {
    "oracle": "oracle",
    "torch.reference": "t.ref",
    "torch.cpu": "t.cpu",
    "jax.xla": "j.xla",
    "jax.cpu": "j.cpu",
    "torch.triton": "t.triton",
    "jax.triton": "j.triton",
    "jax.mosaic_tpu": "j.tpu",
    "torch.flashmla": "t.flashmla",
    "transformers": "hf.eager",
}
TITLES = {
    "kernel": "Kernel level: sparse_attention (row: case class · dtype)",
    "prefill": (
        "Prefill level: whole steps, every plan and cache layout (row: case class · layer kind · dtype; "
        "V4.1: case class · ratio [band] · dtype)"
    ),
    "hf": "External reference: transformers 5.23.0 eager attention, tiny DeepSeek-V4 (row: layer kind · calls · dtype)",
}


def run(levels=LEVELS, quick=False, match=None, log=print) -> dict:
    """Run the suite's cases; returns the JSON-able report (see `main` for the printed form)."""
    t0 = time.perf_counter()
    rows = []

    def keep(name):
        return match is None or match.lower() in name.lower()

    if "kernel" in levels:
        cases = [c for c in C.kernel_cases(dtypes=("float32",) if quick else ("float32", "bfloat16")) if keep(c.row)]
        log(f"kernel level: {len(cases)} cases ...")
        rows += H.run_kernel_cases(cases)
    if "prefill" in levels:
        steps = [
            c
            for c in C.step_cases()
            if any(keep(c.row(r)) for r in c.layers) and (not quick or c.family == QUICK_FAMILY)
        ]
        log(f"prefill level: {len(steps)} steps x SWA/CSA/HCA ...")
        rows += H.merge_rows([r for c in steps for r in H.run_step_case(c)])
        from tests.parity import v41 as V41

        v41 = [
            c
            for c in V41.v41_step_cases()
            if any(keep(c.row(k)) for k in c.case.step().plans) and (not quick or c.family == V41.QUICK_FAMILY)
        ]
        log(f"prefill level, DeepSeek-V4.1: {len(v41)} steps x every layer of the tiny schedule ...")
        rows += V41.run_v41_cases(v41)
    if "hf" in levels:
        from tests.parity import hf_reference as HF

        log("transformers reference: capturing a tiny DeepSeek-V4 (float64) ...")
        calls = HF.capture_calls()
        dtypes = ("float64",) if quick else HF.DTYPES
        rows += [r for r in HF.run_hf(calls, dtypes=dtypes) if keep(r.name)]
    return to_json(rows, time.perf_counter() - t0)


def environment() -> dict:
    import jax
    import torch

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": __import__("os").cpu_count(),
    }
    for pkg in ("numpy", "torch", "jax", "jaxlib", "triton", "transformers"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    env["torch_device"] = str(B.TORCH_DEVICE)
    if torch.cuda.is_available():
        env["cuda_device"] = (
            f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
        )
    env["jax_devices"] = [str(d) for d in jax.devices()]
    return env


def _pair_dict(row: H.Row, a: str, b: str) -> dict:
    c = row.cell(a, b)
    return {"a": a, "b": b, **c.as_dict()}


def to_json(rows: list[H.Row], seconds: float) -> dict:
    levels = {}
    for r in rows:
        levels.setdefault(r.level, []).append(
            {
                "name": r.name,
                "passed": r.passed,
                "cases": r.cases,
                "pairs": [_pair_dict(r, a, b) for a, b in r.pairs],
                "plan_invariance": {
                    k: {**r.invariant(k).as_dict(), "bitwise_required": k in r.bitwise_required} for k in r.invariance
                },
                "not_run": {k: sorted(v) for k, v in r.not_run.items()},
                "errors": r.errors,
                "dlpack_tensors_checked": r.crossings,
                "seconds": round(r.seconds, 3),
                "backend_seconds": {k: round(v, 3) for k, v in r.backend_seconds.items()},
            }
        )
    failed = [f for r in rows for f in r.failures()]
    return {
        "environment": environment(),
        "backends": {k: v.as_dict() for k, v in B.machine_status().items()},
        "tolerances": TABLE,
        "dlpack": {"probe": B.crossing_probe(), "tensors_checked_bitwise": sum(r.crossings for r in rows)},
        "levels": levels,
        "summary": {
            "rows": len(rows),
            "failed_rows": sum(not r.passed for r in rows),
            "passed": not failed,
            "failures": failed,
            "seconds": round(seconds, 1),
        },
    }


# ----------------------------------------------------------------------------- text tables


def _sci(x) -> str:
    if isinstance(x, str):
        return x
    if x == 0:
        return "0"
    s = f"{x:.1e}"
    mant, exp = s.split("e")
    return f"{mant}e{int(exp)}"


def _cell(p: dict | None) -> str:
    if p is None:
        return "-"
    return f"{_sci(p['max_abs'])}/{_sci(p['max_rel'])} {'ok' if p['passed'] else 'FAIL'}"


def _table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in body])


def format_report(rep: dict) -> str:
    out = []
    env = rep["environment"]
    out.append(
        f"dsv4-prefill parity report: torch {env['torch']} ({env['torch_device']}), jax {env['jax']} "
        f"({', '.join(env['jax_devices'])}), triton {env['triton']}, transformers {env['transformers']}"
    )
    out.append("")
    out.append("Backends")
    for name, st in rep["backends"].items():
        out.append(f"  {name:<16} {st['mode'] if st['available'] else 'UNAVAILABLE: ' + st['reason']}")
    out.append("")
    out.append(
        "Tolerances (cell = max|a-b| / max|a-b|÷max|oracle| and ok/FAIL; the oracle is float64 on the same inputs)"
    )
    for dtype in ("float64", "float32", "bfloat16"):
        out.append(f"  {dtype:<9} out: {TABLE[dtype]['out']}; lse/max_logits: {TABLE[dtype]['lse, max_logits']}")
    out.append(f"  all       {TABLE['all']['special values']}; plans: {TABLE['all']['plans']}")
    for level, rows in rep["levels"].items():
        pairs = []
        for r in rows:
            for p in r["pairs"]:
                if (p["a"], p["b"]) not in pairs:
                    pairs.append((p["a"], p["b"]))
        header = ["row"] + [f"{SHORT.get(a, a)}:{SHORT.get(b, b)}" for a, b in pairs]
        body = []
        for r in rows:
            by = {(p["a"], p["b"]): p for p in r["pairs"]}
            body.append([r["name"] + ("" if r["passed"] else "  << FAIL")] + [_cell(by.get(k)) for k in pairs])
        out += ["", TITLES.get(level, level), _table(header, body)]
        inv_backends = [b for b in B.BY_NAME if any(b in r["plan_invariance"] for r in rows)]
        if inv_backends:
            out += [
                "",
                "  Plan invariance: max |variant - primary| over plans and cache layouts (bitwise* = must be 0)",
            ]
            body = []
            for r in rows:
                cells = []
                for b in inv_backends:
                    p = r["plan_invariance"].get(b)
                    cells.append(
                        "-"
                        if p is None
                        else f"{_sci(p['max_abs'])}{'*' if p['bitwise_required'] else ''} {'ok' if p['passed'] else 'FAIL'}"
                    )
                body.append([r["name"]] + cells)
            out.append(_table(["row"] + [SHORT[b] for b in inv_backends], body))
        reasons = {}
        for r in rows:
            for b, rs in r["not_run"].items():
                for reason in rs:
                    reasons.setdefault((b, reason), []).append(r["name"])
        if reasons:
            out += ["", "  Not run:"]
            for (b, reason), names in reasons.items():
                where = "every row" if len(names) == len(rows) else f"{len(names)} rows"
                out.append(f"    {b:<16} {where}: {reason}")
        errors = [e for r in rows for e in r["errors"]]
        for e in errors:
            out.append(f"  ERROR {e}")
    dl = rep["dlpack"]
    probe = ", ".join(
        f"{k}: {'bitwise' if v['to_jax_bitwise'] and v['round_trip_bitwise'] else 'BITS DIFFER'}"
        f"{' zero-copy' if v['zero_copy'] else ' copied'}"
        for k, v in dl["probe"].items()
    )
    out += [
        "",
        f"DLPack torch -> JAX: {dl['tensors_checked_bitwise']} case tensors checked bitwise equal after crossing; {probe}",
    ]
    s = rep["summary"]
    verdict = "all rows passed" if s["passed"] else f"{s['failed_rows']} rows FAILED"
    out.append(f"Summary: {s['rows']} rows, {verdict}, {s['seconds']} s")
    for f in s["failures"][:20]:
        out.append(f"  {f}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", type=Path, help="also write the report as JSON here")
    ap.add_argument(
        "--quick", action="store_true", help="fp32 kernel rows, tiny fp32 prefill family, float64 transformers rows"
    )
    ap.add_argument("--levels", default=",".join(LEVELS), help=f"comma-separated subset of {','.join(LEVELS)}")
    ap.add_argument("--match", help="only rows whose name contains this text (case-insensitive)")
    args = ap.parse_args(argv)
    levels = [x.strip() for x in args.levels.split(",") if x.strip()]
    bad = [x for x in levels if x not in LEVELS]
    if bad:
        ap.error(f"--levels: unknown {bad}; expected a subset of {list(LEVELS)}")
    rep = run(levels, quick=args.quick, match=args.match, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_report(rep))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rep, indent=1))
        print(f"JSON: {args.json}")
    return 0 if rep["summary"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
