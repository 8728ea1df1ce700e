"""The parity suite's cases, in NumPy: kernel-level `sparse_attention` inputs and whole prefill steps.

Kernel cases (`kernel_cases`) are grouped in classes, one report row per class and dtype:
random inputs and every adversarial input of the FlashMLA contract (spec section 2). Prefill
cases (`step_cases`) are whole steps with an SWA, a CSA and an HCA layer over one batch, built
on `tests/cases.py` (`make_case` gives each layer its latents, queries, top-k rows and sink);
they cover the boundary classes of spec section 5, ragged batches with `query_len == 0`
requests, long prefixes, a prompt split over several steps, and V4-Flash / V4-Pro head counts
and index widths, with sequence lengths and D scaled down for CPU.

bf16 cases use FlashMLA's data scale (kv ~ N(0, 0.1^2), logits of std ~1.5) and D = 512 where
the class allows, so that FlashMLA joins every bf16 kernel row on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import planner as P
from tests.cases import PrefillCase, make_case

INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
DTYPE_TAG = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16"}


# ----------------------------------------------------------------------------- kernel level


@dataclass
class KernelCase:
    """One `sparse_attention` call: q (T, H, D), kv (S, D), indices (T, K) int32, optional sink (H,)
    and topk_length (T,); float32 masters, rounded to `dtype` when the harness builds tensors."""

    klass: str
    name: str
    dtype: str
    q: np.ndarray
    kv: np.ndarray
    indices: np.ndarray
    sink: np.ndarray | None = None
    topk_length: np.ndarray | None = None
    tiny: bool = True  # small enough for the interpreters on CPU

    @property
    def sm_scale(self) -> float:
        return self.q.shape[2] ** -0.5

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def row(self) -> str:
        return f"{self.klass} · {DTYPE_TAG[self.dtype]}"

    def describe(self) -> str:
        T, H, D = self.q.shape
        return f"{self.name} (T={T} H={H} D={D} S={self.kv.shape[0]} K={self.indices.shape[1]})"


def random_inputs(rng, T, H, D, S, dtype):
    """q, kv with logits of std ~1.5: neither flat nor one-hot. bf16: kv ~ N(0, 0.1^2) (FlashMLA's scale)."""
    kv_scale = 1.0 if dtype != "bfloat16" else 0.1
    kv = (kv_scale * rng.standard_normal((S, D))).astype(np.float32)
    q = ((1.5 / kv_scale) * rng.standard_normal((T, H, D))).astype(np.float32)
    return q, kv


def random_indices(rng, T, S, K, *, invalid=0.2, duplicates=0.0):
    """(T, K) int32 in 0..S-1 with a fraction `invalid` of every invalid form (-1, other negatives,
    S and beyond, int32 extremes) and a fraction `duplicates` of columns repeating earlier ones."""
    idx = rng.integers(0, max(S, 1), (T, K)).astype(np.int64)
    u = rng.random((T, K))
    forms = np.array([-1, -7, INT32_MIN, S, S + 3, INT32_MAX], np.int64)
    bad = u < invalid
    idx[bad] = forms[rng.integers(0, len(forms), int(bad.sum()))]
    if duplicates > 0 and K > 1:
        dup = rng.random((T, K)) < duplicates
        dup[:, 0] = False
        src = (rng.random((T, K)) * np.arange(K)[None, :]).astype(np.int64)  # an earlier column
        idx = np.where(dup, np.take_along_axis(idx, src, axis=1), idx)
    return idx.astype(np.int32)


def random_sink(rng, H, kind):
    if kind is None:
        return None
    if kind == "random":
        return rng.standard_normal(H).astype(np.float32)
    if kind == "mixed":  # every special value on some head
        base = np.array([-np.inf, 0.0, 30.0, 200.0, np.inf], np.float32)
        return np.concatenate([base, rng.standard_normal(max(H - 5, 0)).astype(np.float32)])[:H]
    return np.full(H, float(kind), np.float32)


def random_kernel_case(
    klass, name, dtype, *, seed, T, H, D, S, K, invalid=0.2, duplicates=0.0, topk="random", sink="random", tiny=True
) -> KernelCase:
    """A random call. topk: "random" (0 .. K+3 per row), "none", or an int array."""
    rng = np.random.default_rng(seed)
    q, kv = random_inputs(rng, T, H, D, S, dtype)
    idx = random_indices(rng, T, S, K, invalid=invalid, duplicates=duplicates)
    if isinstance(topk, str):
        tl = rng.integers(0, K + 4, T).astype(np.int32) if topk == "random" else None
    else:
        tl = np.asarray(topk, np.int32)
    return KernelCase(klass, name, dtype, q, kv, idx, random_sink(rng, H, sink), tl, tiny)


def _d(dtype, fp32_dim):
    """bf16 rows use D = 512 (FlashMLA's), fp32 rows a small D (cheaper, and other code paths)."""
    return 512 if dtype == "bfloat16" else fp32_dim


def kernel_cases(dtypes=("float32", "bfloat16")) -> list[KernelCase]:
    """Every kernel-level case, fixed seeds. Report rows: `KernelCase.row` (class · dtype).

    Most cases share one shape per dtype (T=8, H=16, S=64, K=256; D=64 fp32, 512 bf16) and differ
    in content only: on CPU, compiling a JAX program per new shape costs more than attention.
    """
    out = []
    T, H, S, K = 8, 16, 64, 256
    for dtype in dtypes:
        D = _d(dtype, 64)
        fp32 = dtype == "float32"

        def case(klass, name, seed, **kw):
            shape = dict(T=T, H=H, D=D, S=S, K=K)
            shape.update(kw.pop("shape", {}))
            c = random_kernel_case(klass, name, dtype, seed=seed, **shape, **kw)
            out.append(c)
            return c

        case("random", "topk_length and sink", 1)
        case(
            "random",
            "no topk_length, no sink",
            2,
            shape=dict(T=5, H=20, D=_d(dtype, 48), S=60, K=150),
            topk="none",
            sink=None,
        )

        # every invalid form mixed in, and rows made of one form only
        c = case("invalid indices", "all forms", 3, invalid=0.4)
        for row, value in enumerate([-1, -7, S, INT32_MAX, INT32_MIN]):
            c.indices[row] = value

        # topk_length below the valid prefix, zero, negative, past the row
        c = case("topk_length < valid prefix", "cuts", 4, invalid=0.0)
        c.topk_length = np.array([0, 1, 37, 128, 255, 256, 300, -4], np.int32)

        c = case("duplicated indices", "16x row 3 + 240x row 7", 5, invalid=0.0)
        c.indices[:, :16], c.indices[:, 16:] = 3, 7
        c.indices[1] = 4  # one row: a single key K times
        case("duplicated indices", "random repeats", 6, invalid=0.1, duplicates=0.5)

        for sink in (float("-inf"), 0.0, 30.0, "mixed"):  # mixed: -inf, 0, 30, 200, +inf and random heads
            case("sinks -inf / 0 / large", f"sink={sink}", 7, sink=sink)

        c = case("rows without a valid key", "every other row", 8)
        c.indices[::2] = -1
        c.topk_length[1] = 0
        case("rows without a valid key", "no key anywhere", 9, topk=np.zeros(T, np.int32))
        case("rows without a valid key", "T = 0", 11, shape=dict(T=0))
        if fp32:
            case("rows without a valid key", "S = 1", 10, shape=dict(S=1), invalid=0.5)

        widths = (1, 37, 128, 129, 300) if fp32 else (37, 129)
        for k in widths:
            case("widths K % 128 == 0 and != 0", f"K={k}", 20 + k, shape=dict(K=k))

        # rows no valid entry points at hold NaN (uninitialised workspace), row 0 included
        c = case("NaN in unreferenced kv rows", "NaN rows", 12)
        cols = np.arange(K)[None, :]
        valid = (c.indices >= 0) & (c.indices < S) & (cols < c.topk_length[:, None])
        c.indices = np.where(valid & (c.indices == 0), 1, c.indices).astype(np.int32)
        valid = (c.indices >= 0) & (c.indices < S) & (cols < c.topk_length[:, None])
        c.kv[np.setdiff1d(np.arange(S), c.indices[valid])] = np.nan

        dims = [(16, 576)] + ([(3, 33), (1, 16), (20, 40)] if fp32 else [])  # bf16 rows use D = 512 already
        for h, d in dims:
            case("head dims (576 = 512 + rope tail)", f"H={h} D={d}", 30 + d, shape=dict(T=3, H=h, D=d, S=40, K=64))

        # the models' head counts and index widths: a valid prefix (top-k + window), -1 padding
        for klass, h, k, t in (("V4-Flash: H=64, K=640", 64, 640, 4), ("V4-Pro: H=128, K=1152", 128, 1152, 2)):
            c = case(klass, "model shape", h, shape=dict(T=t, H=h, S=3000, K=k), invalid=0.0)
            c.topk_length = np.array([k, k - 300, 140, 1][:t], np.int32)
            c.indices[np.arange(k)[None, :] >= c.topk_length[:, None]] = -1
    return out


# ----------------------------------------------------------------------------- prefill level


VARIANTS = (  # (policy, cache layout); the first is the primary one every backend runs
    ("adaptive", "paged"),
    ("adaptive", "logical"),
    ("fixed", "paged"),
    ("fixed", "logical"),
    ("per_request", "paged"),
    ("per_request", "logical"),
    ("adaptive+length-order", "paged"),
    ("adaptive+tight-budget", "paged"),
)
PRIMARY = VARIANTS[0]
# Larger classes: one of each plan and layout (each variant is another run of every layer).
FEW_VARIANTS = (PRIMARY, ("fixed", "paged"), ("per_request", "logical"), ("adaptive+tight-budget", "paged"))
TWO_VARIANTS = (PRIMARY, ("per_request", "paged"))  # the model-shape classes: heads and widths are the point


@dataclass
class StepCase:
    """One prefill step of a batch, with an SWA, a CSA and an HCA layer (`layers[kind]`).

    splits: for a one-request prompt, the step boundaries of the same prompt prefilled over
    several steps (chunked prefill); its output must equal the one-step output.
    """

    klass: str
    name: str
    dtype: str
    layers: dict[P.LayerKind, PrefillCase]
    tiny: bool = True
    splits: list[tuple[int, int]] | None = None
    variants: tuple = VARIANTS
    jax_layouts: tuple = ("paged", "logical")  # layouts JAX runs (each layout compiles its own program)
    block_size: int = 16
    family: str = "tiny"  # cases of one family share shapes, hence compiled JAX programs: test them together
    plan_kw: dict = field(default_factory=dict)  # PlanConfig fields (engine limits, prefill_chunk_size)

    @property
    def first(self) -> PrefillCase:
        return next(iter(self.layers.values()))

    @property
    def layer_specs(self) -> list[P.LayerSpec]:
        """What `plan_step` plans: each layer's kind and ratio."""
        return [c.layer for c in self.layers.values()]

    @property
    def head_dim(self) -> int:
        return self.first.q.shape[2]

    @property
    def topk(self) -> int:
        return self.first.topk

    @property
    def batch(self) -> P.PrefillBatch:
        return self.first.batch

    def plan_config(self, variant) -> P.PlanConfig:
        """The variant's plan: "adaptive", "fixed", "per_request", or adaptive with a length order or
        a tight budget (as many rows as the widest compressed part plus a window and a bit: splits
        long requests along their queries and packs few requests per chunk)."""
        policy, _ = variant
        c = self.first
        kw = dict(
            window_size=c.window_size,
            max_model_len=max(max(c.seq_lens), 1),
            max_num_batched_tokens=max(max(c.query_lens), 1),
        )
        kw.update(self.plan_kw)
        if policy == "adaptive+length-order":
            policy, kw["order"] = "adaptive", "length"
        elif policy == "adaptive+tight-budget":
            policy, kw["budget_rows"] = "adaptive", max(c.seq_lens) // 4 + c.window_size + 4
        return P.PlanConfig(policy=policy, **kw)

    def row(self, kind) -> str:
        return f"{self.klass} · {P.LayerKind.of(kind).name} · {DTYPE_TAG[self.dtype]}"

    def describe(self) -> str:
        c = self.first
        T, H, D = c.q.shape
        return (
            f"{self.name} (seq_lens={c.seq_lens} query_lens={c.query_lens} W={c.window_size} topk={c.topk} H={H} D={D})"
        )


def step_case(
    klass,
    name,
    seq_lens,
    query_lens,
    *,
    dtype="float32",
    window_size=8,
    topk=6,
    H=4,
    D=32,
    seed=0,
    ratios=(0, 4, 128),
    family=None,
    topk_junk=False,
    **kw,
) -> StepCase:
    """A step over one batch with a layer per ratio (V4.0's kinds: 0 SWA, 4 CSA, 128 HCA), keyed by
    kind. topk_junk: CSA top-k rows hold arbitrary ids (future entries, negatives, huge) past each
    token's min((p+1)//r, topk) used entries, which every backend must ignore."""
    cases = [
        make_case(name, seq_lens, query_lens, r, window_size=window_size, topk=topk, H=H, D=D, seed=seed * 10 + i)
        for i, r in enumerate(ratios)
    ]
    layers = {c.kind: c for c in cases}
    if topk_junk and P.LayerKind.CSA in layers:
        c = layers[P.LayerKind.CSA]
        rng = np.random.default_rng(seed)
        used = np.minimum((c.batch.token_position + 1) // c.ratio, topk)
        past = np.arange(topk)[None, :] >= used[:, None]
        noise = rng.choice(np.array([-1, -3, INT32_MIN, INT32_MAX, 10**6]), size=past.shape)
        future = (used[:, None] + rng.integers(0, 50, past.shape)).astype(np.int64)  # not visible yet
        c.topk_rows = np.where(past, np.where(rng.random(past.shape) < 0.5, noise, future), c.topk_rows).astype(
            np.int32
        )
    if family is None:
        family = f"tiny-{DTYPE_TAG[dtype]}" if (window_size, topk, H, D) == (8, 6, 4, 32) else name
    return StepCase(klass, name, dtype, layers, family=family, **kw)


def split_points(length: int, boundaries) -> list[tuple[int, int]]:
    edges = [0, *boundaries, length]
    return list(zip(edges[:-1], edges[1:]))


def step_cases() -> list[StepCase]:
    """Every prefill-level case, fixed seeds (W = 8, top-k 6, H = 4, D = 32 unless the class says)."""
    W = 8
    return [
        # spec section 5: fresh prompts shorter and longer than the window
        step_case("fresh prompts", "fresh", [3, W - 1, W, W + 1, 21], [3, W - 1, W, W + 1, 21], seed=1),
        # queries at positions W-1/W, r-1/r (4), 127/128 and 255/256 (r = 128), and beyond
        step_case("boundaries W, 4, 128", "boundaries", [W + 1, 5, 129, 131, 257, 12], [2, 2, 3, 4, 3, 12], seed=2),
        # chunked prefill: long prefixes, query chunks not aligned to 4, 128 or W
        step_case("long prefixes", "long-prefix", [300, 517, 260], [7, 13, 1], seed=3),
        # query_len == 0 requests (KV-transfer loads) first, between and last; a step of only those
        step_case(
            "ragged, query_len == 0", "zero-query", [40, 0, 200, 9, 64, 17, 300, 50], [0, 0, 5, 9, 0, 17, 0, 0], seed=4
        ),
        step_case("ragged, query_len == 0", "no queries at all", [40, 9], [0, 0], seed=5),
        # the indexer's rows past the used entries hold anything (ignored by contract)
        step_case(
            "top-k rows: junk past the used entries",
            "topk-junk",
            [9, 30, 41, 100],
            [9, 12, 6, 20],
            seed=11,
            topk_junk=True,
        ),
        # the same classes in bf16 (against the fp32-or-better oracle on bf16-rounded inputs)
        step_case(
            "boundaries W, 4, 128",
            "boundaries",
            [W + 1, 5, 129, 131, 257, 12],
            [2, 2, 3, 4, 3, 12],
            seed=2,
            dtype="bfloat16",
            jax_layouts=("paged",),
        ),
        step_case(
            "long prefixes",
            "long-prefix",
            [300, 517, 260],
            [7, 13, 1],
            seed=3,
            dtype="bfloat16",
            jax_layouts=("paged",),
        ),
        # V4-Flash / V4-Pro: 64 / 128 heads, top-k 512 / 1024, W = 128: index widths 640 / 1152
        step_case(
            "V4-Flash: H=64, width 640",
            "v4-flash",
            [4200, 2100, 700],
            [3, 2, 0],
            window_size=128,
            topk=512,
            H=64,
            D=16,
            seed=6,
            variants=TWO_VARIANTS,
            jax_layouts=("paged",),
        ),
        step_case(
            "V4-Pro: H=128, width 1152",
            "v4-pro",
            [4200, 300],
            [2, 3],
            window_size=128,
            topk=1024,
            H=128,
            D=16,
            seed=7,
            variants=TWO_VARIANTS,
            jax_layouts=("paged",),
        ),
        # one 300-token prompt over six steps (boundaries 37, 128, 136, 211, 256: multiples of
        # 4, 8 and 128 and not) against the same prompt in one step
        step_case(
            "prompt split over steps",
            "split",
            [300],
            [300],
            seed=8,
            tiny=False,
            splits=split_points(300, [37, 128, 136, 211, 256]),
            variants=(PRIMARY,),
            jax_layouts=("paged",),
        ),
        # a long context: 40000 tokens of prefix (312 HCA entries, 10000 CSA entries)
        step_case(
            "long context 40000",
            "long-context",
            [40000, 300],
            [4, 300],
            window_size=128,
            topk=64,
            H=2,
            D=16,
            seed=9,
            tiny=False,
            variants=FEW_VARIANTS,
            jax_layouts=("paged",),
        ),
        # FlashMLA's shapes in bf16: V4-Flash heads, D = 512
        step_case(
            "FlashMLA shape: H=64, D=512",
            "flashmla-shape",
            [700, 300, 130],
            [5, 3, 0],
            window_size=128,
            topk=512,
            H=64,
            D=512,
            seed=10,
            dtype="bfloat16",
            tiny=False,
            variants=FEW_VARIANTS,
            jax_layouts=("paged",),
        ),
    ]
