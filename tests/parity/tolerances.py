"""The parity tolerance table and the one comparison every pair of backends goes through.

Every comparison measures two outputs `a` and `b` of the same inputs against the scale of the
float64 oracle's output `ref` on those inputs (for bf16: the inputs after rounding to bf16, so
the oracle is the fp32-or-better reference FlashMLA's tests use). Reported figures:

  max_abs = max |a - b|                  max_rel = max_abs / max |ref|

| inputs   | out passes if                                                     | lse, max_logits     |
|----------|-------------------------------------------------------------------|---------------------|
| float64  | max_rel <= 1e-10                                                  | 1e-10 * max(1,|ref|) |
| float32  | max_rel <= 1e-5                                                   | 1e-5 * max(1,|ref|) |
| bfloat16 | every element |a-b| <= 8e-4 or |a-b| <= 3/128 * (|ref| + 1e-6),    | 1e-4 * max(1,|ref|) |
|          | and cosine diff 1 - 2<a,b>/(|a|^2+|b|^2) <= 7e-6 (FlashMLA's test) |                     |

The same bound holds for every pair, oracle or not (fp32 backends land near 1e-7, far inside it).
lse / max_logits must also have the oracle's +inf / -inf pattern exactly (rows without a valid
key), and nothing may be NaN. Plan invariance is bitwise: max |a - b| == 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BF16_ABS = 8e-4
BF16_REL = 3 / 128
BF16_COS = 7e-6
OUT_REL = {"float64": 1e-10, "float32": 1e-5}
STAT_REL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 1e-4}

TABLE = {
    "float64": {"out": "max|a-b| / max|oracle| <= 1e-10", "lse, max_logits": "|a-b| <= 1e-10 * max(1, |oracle|)"},
    "float32": {"out": "max|a-b| / max|oracle| <= 1e-5", "lse, max_logits": "|a-b| <= 1e-5 * max(1, |oracle|)"},
    "bfloat16": {
        "out": "each element |a-b| <= 8e-4 or <= 3/128 * (|oracle| + 1e-6); cosine diff <= 7e-6 "
        "(FlashMLA's test; oracle = float64 on the same bf16-rounded inputs)",
        "lse, max_logits": "|a-b| <= 1e-4 * max(1, |oracle|)",
    },
    "all": {
        "special values": "same +inf/-inf pattern as the oracle, no NaN",
        "plans": "bitwise on torch.reference, torch.cpu, jax.xla and jax.cpu",
    },
}


@dataclass(frozen=True)
class Agreement:
    """One comparison's figures: max |a-b|, that over max |ref|, and whether it is within tolerance."""

    max_abs: float
    max_rel: float
    passed: bool
    detail: str = ""

    def as_dict(self) -> dict:
        return {
            "max_abs": _json_float(self.max_abs),
            "max_rel": _json_float(self.max_rel),
            "passed": self.passed,
            "detail": self.detail,
        }


def _json_float(x: float):
    return x if np.isfinite(x) else str(x)


def compare_out(a: np.ndarray, b: np.ndarray, ref: np.ndarray, dtype: str) -> Agreement:
    """Attention outputs `a` and `b` (float64 arrays of one shape) under the table's rule for `dtype`."""
    if a.shape != b.shape or a.shape != ref.shape:
        return Agreement(np.inf, np.inf, False, f"shapes differ: {a.shape} vs {b.shape} (oracle {ref.shape})")
    if a.size == 0:
        return Agreement(0.0, 0.0, True)
    bad = np.isnan(a) | np.isnan(b)
    if bad.any():
        return Agreement(np.nan, np.nan, False, f"{int(bad.sum())} NaN outputs")
    diff = np.abs(a - b)
    max_abs = float(diff.max())
    scale = float(np.abs(ref).max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else np.inf)
    if dtype == "bfloat16":
        bound = np.maximum(BF16_ABS, BF16_REL * (np.abs(ref) + 1e-6))
        over = diff > bound
        denom = float((a * a + b * b).sum())
        cos_diff = 0.0 if denom < 1e-12 else 1.0 - 2.0 * float((a * b).sum()) / denom
        if over.any():
            return Agreement(
                max_abs, max_rel, False, f"{int(over.sum())} of {over.size} elements outside FlashMLA's bound"
            )
        if cos_diff > BF16_COS:
            return Agreement(max_abs, max_rel, False, f"cosine diff {cos_diff:.3g} > {BF16_COS}")
        return Agreement(max_abs, max_rel, True)
    tol = OUT_REL[dtype]
    return Agreement(max_abs, max_rel, max_rel <= tol, "" if max_rel <= tol else f"max_rel {max_rel:.3g} > {tol}")


def compare_stat(a: np.ndarray, b: np.ndarray, ref: np.ndarray, dtype: str, name: str) -> Agreement:
    """lse or max_logits: the oracle's inf pattern exactly, finite entries within STAT_REL."""
    if a.shape != b.shape or a.shape != ref.shape:
        return Agreement(np.inf, np.inf, False, f"{name}: shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return Agreement(0.0, 0.0, True)
    if np.isnan(a).any() or np.isnan(b).any():
        return Agreement(np.nan, np.nan, False, f"{name}: NaN")
    for side in (a, b):
        if not (
            np.array_equal(np.isposinf(side), np.isposinf(ref)) and np.array_equal(np.isneginf(side), np.isneginf(ref))
        ):
            return Agreement(np.inf, np.inf, False, f"{name}: +inf/-inf pattern differs from the oracle's")
    fin = np.isfinite(ref)
    if not fin.any():
        return Agreement(0.0, 0.0, True)
    diff = np.abs(a[fin] - b[fin])
    rel = diff / np.maximum(1.0, np.abs(ref[fin]))
    tol = STAT_REL[dtype]
    worst = float(rel.max())
    return Agreement(float(diff.max()), worst, worst <= tol, "" if worst <= tol else f"{name}: {worst:.3g} > {tol}")


def combine(parts: list[Agreement], extra: list[Agreement] = ()) -> Agreement:
    """Many comparisons of one pair as one report cell: the worst figures of `parts` (outputs), and
    a pass only if every part and every `extra` (lse / max_logits checks) passed."""
    failed = [p.detail for p in list(parts) + list(extra) if not p.passed]
    if not parts:
        return Agreement(0.0, 0.0, not failed, "; ".join(failed[:3]))
    if any(np.isnan(p.max_abs) for p in parts):
        return Agreement(np.nan, np.nan, False, "; ".join(failed[:3]))
    return Agreement(max(p.max_abs for p in parts), max(p.max_rel for p in parts), not failed, "; ".join(failed[:3]))
