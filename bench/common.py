"""What the bench scripts share: the FLOP convention, timing, memory readings, workloads, inputs.

Every bench script runs from the repository root as `python -m bench.NAME`; scripts import this
module (and the library, and `tools`), never each other. Nothing heavy is imported here: torch,
jax and the tiny-checkpoint writer load inside the functions that need them, so a script can set
its environment (TRITON_INTERPRET, XLA flags) before the frameworks start.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from planner.report import SPEC_LIMITS, SPEC_QUERY_LENS, SPEC_SEQ_LENS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- FLOPs

FLASHMLA_PUBLISHED_TFLOPS = 640.0  # FlashMLA README: sparse prefill on H800, the anchor for "vs 640"
TFLOPS_CONVENTION = "TFLOPS = 2 * sum(valid indices) * H * (512 + 512) / time"


def attention_flop(valid_indices: int, heads: int, d_qk: int = 512, d_v: int = 512) -> int:
    """FLOPs of one sparse-attention call by FlashMLA's count: 2 * valid indices * H * (d_qk + d_v)
    (QK^T and PV only; invalid or padded index slots cost nothing)."""
    return 2 * int(valid_indices) * int(heads) * (int(d_qk) + int(d_v))


def tflops(valid_indices: int, heads: int, seconds: float, d_qk: int = 512, d_v: int = 512) -> float:
    """`attention_flop` / `seconds`, in TFLOPS (10^12 FLOP/s)."""
    return attention_flop(valid_indices, heads, d_qk, d_v) / seconds / 1e12


# ----------------------------------------------------------------------------- timing


def median_seconds(fn, repeat: int, warmup: int = 1, sync=None) -> float:
    """Median wall time of `fn()` over `repeat` runs after `warmup` untimed ones.

    `sync(result)` runs inside each timed interval (e.g. `jax.block_until_ready`, or a function
    that calls `torch.cuda.synchronize()`), so asynchronous work is counted.
    """
    done = sync or (lambda result: result)
    for _ in range(warmup):
        done(fn())
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        done(fn())
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def torch_time_ms(fn, device: str, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn()`: CUDA events on "cuda", wall time otherwise."""
    if device != "cuda":
        return median_seconds(fn, iters, warmup) * 1e3
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_interleaved(calls: dict, repeats: int) -> dict:
    """name -> (first call's extra time over the steady state, median steady time), in seconds.

    Each call runs once (timed apart: trace, compile, lazy set-up), then `repeats` rounds of all
    calls round-robin, so every variant sees the same machine state. Each call must finish its
    work before it returns.
    """
    first, times = {}, {name: [] for name in calls}
    for name, call in calls.items():
        t0 = time.perf_counter()
        call()
        first[name] = time.perf_counter() - t0
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    steady = {name: float(np.median(t)) for name, t in times.items()}
    return {name: (max(0.0, first[name] - steady[name]), steady[name]) for name in calls}


# ----------------------------------------------------------------------------- memory (Linux /proc)


def proc_status_kib(field: str, pid="self") -> int:
    """A kB field of /proc/PID/status ("VmRSS": resident now, "VmHWM": peak resident)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def available_kib() -> int:
    """MemAvailable of /proc/meminfo (a huge number where the kernel does not report it)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 1 << 60


def reset_peak_rss() -> bool:
    """Set this process's VmHWM to its current RSS (/proc/self/clear_refs "5"); False where the
    file is not writable (VmHWM then still holds the peak since start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------- child processes


def module_command(module: str, *args) -> list[str]:
    """The command line that runs `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *map(str, args)]


def child_env(**extra: str) -> dict:
    """This environment plus `extra`, with the repository root first on PYTHONPATH (so a child
    `python -m bench.NAME` finds the packages from any working directory)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


# ----------------------------------------------------------------------------- CPU ceilings

# Caps of torch's GEMM libraries per instruction set of our kernels (MKL serves torch's float32
# matmul, oneDNN its bf16 matmul): an instruction set forced below the machine's
# (DSV4_PREFILL_CPU_ISA) is read against a matmul capped alike, as on a CPU that has only it.
GEMM_CAPS = {
    "generic": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx512bf16": {},
}


def matmul_gflops(dtype: str, threads: int, repeats: int = 5, n: int = 2048) -> float:
    """The best of `repeats` n^3 torch.matmul calls ("bf16" or "fp32") on `threads` threads, in
    GFLOP/s (the best: one slow call on a shared machine would lower every ratio read against it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best / 1e9


_MATMUL_CHILD = (
    "import sys; from bench.common import matmul_gflops as m; print(m(sys.argv[1], *map(int, sys.argv[2:])))"
)


def cpu_ceiling_dtype() -> str:
    """The dtype whose matmul is the ceiling of our CPU kernels as they run here: "bf16" where
    the attention kernel multiplies bf16 with bf16 dot products (AVX512-BF16), else "fp32" (the
    kernels widen bf16 to float32; torch's bf16 matmul on such a CPU is emulated and no ceiling)."""
    from dsv4_cpu import binding

    return "bf16" if binding.best_isa(binding.BF16) == "avx512bf16" else "fp32"


def cpu_ceiling(threads: int, repeats: int = 5, n: int = 2048) -> dict:
    """The machine's ceiling for our CPU kernels, timed for its one dtype only
    (`cpu_ceiling_dtype`): {"dtype", "gflops" (the best of `repeats` n^3 torch.matmul calls on
    `threads` threads), "isa" (our kernels' instruction set), "capped" (whether the matmul ran in a
    child process with its GEMM libraries capped to that set, `GEMM_CAPS`: DSV4_PREFILL_CPU_ISA
    forced a set below the machine's)}."""
    import subprocess

    from dsv4_cpu import binding

    if threads < 1:
        raise ValueError(f"threads: expected >= 1, got {threads}")
    dtype = cpu_ceiling_dtype()
    isa = binding.best_isa(binding.BF16)
    built = [i for i, ok in binding.isa_supported().items() if ok and i in GEMM_CAPS]
    capped = isa != max(built, key=binding.ISAS.index)
    if capped:
        res = subprocess.run(
            [sys.executable, "-c", _MATMUL_CHILD, dtype, str(threads), str(repeats), str(n)],
            env=child_env(**GEMM_CAPS[isa]),
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            raise RuntimeError(f"the ceiling's matmul child failed: {res.stderr.strip()[-500:]}")
        gflops = float(res.stdout.split()[-1])
    else:
        gflops = matmul_gflops(dtype, threads, repeats, n)
    return dict(dtype=dtype, gflops=gflops, isa=isa, capped=capped)


def ceiling_call(c: dict, threads: int, n: int = 2048):
    """One n^3 torch.matmul of `cpu_ceiling` result c's dtype on `threads` threads, as a zero-argument
    call to time in the same rounds as the kernels (`time_interleaved`): on a shared machine a
    ceiling timed once, before the cases, meets another load than the cases do. None where c was
    timed in a capped child process (its GEMM libraries cannot be capped in this one).
    Returns (call, flop of one call)."""
    if c["capped"]:
        return None, 0.0
    import torch

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[c["dtype"]]
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)

    def call():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return a @ b
        finally:
            torch.set_num_threads(before)

    return call, 2.0 * n**3


def describe_ceiling(c: dict) -> str:
    """One line naming a `cpu_ceiling` result."""
    how = f", GEMM capped to {c['isa']} as our kernels are" if c["capped"] else ""
    return f"{c['dtype']} torch.matmul 2048^3 {c['gflops']:.0f} GFLOP/s (our kernels: {c['isa']}{how})"


# ----------------------------------------------------------------------------- checkpoints


@contextlib.contextmanager
def checkpoint_or_tiny(checkpoint=None, dtype: str = "float32"):
    """Yield `checkpoint`, or (None) the tiny random checkpoint (`tools.tiny_checkpoint`, seed 0,
    `dtype`) written to a temporary directory that is removed afterwards."""
    if checkpoint is not None:
        yield str(checkpoint)
        return
    from tools.tiny_checkpoint import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        yield str(write_tiny_checkpoint(os.path.join(tmp, "tiny"), seed=0, dtype=dtype))


# ----------------------------------------------------------------------------- workloads


def _limits(window_size=128, max_model_len=65536, max_num_batched_tokens=8192, prefill_chunk_size=4):
    return dict(
        window_size=window_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_size=prefill_chunk_size,
    )


def workloads(seed: int = 0, scale: float = 1.0) -> dict[str, tuple[list[int], list[int], dict]]:
    """Named prefill workloads: name -> (seq_lens, query_lens, limits the engine runs under).

    `scale` < 1 shrinks lengths for CPU attention runs.
    """
    rng = np.random.default_rng(seed)
    s = lambda x: max(1, int(x * scale))  # noqa: E731
    ints = lambda lo, hi, n: [int(x) for x in rng.integers(s(lo), max(s(lo) + 1, s(hi)), n)]  # noqa: E731
    out = {"spec-example": (list(SPEC_SEQ_LENS), list(SPEC_QUERY_LENS), dict(SPEC_LIMITS))}

    # Many short chats: fresh prompts of 16..256 tokens filling an 8K-token step.
    q = []
    while sum(q) < s(8192) - 256:
        q.append(int(rng.integers(s(16), s(256) + 1)))
    out["short-chats"] = (q, q, _limits(max_num_batched_tokens=s(8192)))

    # Long-context RAG: four 60K..64K documents, each in the middle of a 2K-token prefill chunk.
    seq = ints(60000, 64001, 4)
    out["long-rag"] = (seq, [s(2048)] * 4, _limits(max_model_len=s(65536), max_num_batched_tokens=s(8192)))

    # Mixed: one long continuation, medium documents, short chats, and KV-transfer loads (q = 0).
    seq = [s(50000)] + ints(2000, 8000, 6) + ints(20, 200, 16)
    qry = [s(1024)] + [s(256)] * 6 + seq[7:]
    seq += [s(30000), s(12000)]
    qry += [0, 0]
    out["mixed"] = (seq, qry, _limits(max_model_len=s(65536), max_num_batched_tokens=s(8192)))
    return out


def scaling_batch(num_requests: int, seed: int = 0, max_model_len: int = 65536, tokens: int = 16384):
    """`num_requests` requests sharing a `tokens` budget, at random context lengths."""
    rng = np.random.default_rng(seed)
    per = max(1, tokens // num_requests)
    qry = rng.integers(1, per + 1, num_requests)
    seq = np.maximum(qry, rng.integers(1, max_model_len + 1, num_requests))
    return seq.tolist(), qry.tolist()


# ----------------------------------------------------------------------------- inputs


def recent_topk_rows(token_position, topk: int, ratio: int = 4) -> np.ndarray:
    """(tokens, topk) int32 top-k rows of a compressed layer: each token's most recent
    min(visible, topk) compressed entries, newest first, then -1 (a stand-in for the indexer)."""
    visible = (np.asarray(token_position, np.int64) + 1) // ratio
    rows = (visible[:, None] - 1 - np.arange(topk)[None, :]).astype(np.int32)
    rows[np.arange(topk)[None, :] >= np.minimum(visible, topk)[:, None]] = -1
    return rows


def random_sparse_inputs(T: int, H: int, D: int, S: int, K: int, seed: int = 0, full_rows: float | None = None):
    """NumPy inputs of one sparse-attention call (float64 / int32; cast them to the dtype wanted).

    q (T, H, D) and kv (S, D) ~ N(0, 0.1^2); indices (T, K) uniform in [0, S), -1 from each row's
    topk_length on; sink (H,) ~ N(0, 1). Row lengths: uniform in K//2..K, or with `full_rows=p`,
    K with probability p and uniform in 1..K otherwise. Returns
    (q, kv, indices, sink, topk_length, number of valid indices).
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, D)) / 10
    kv = rng.standard_normal((S, D)) / 10
    if full_rows is None:
        topk_length = rng.integers(K // 2, K + 1, T).astype(np.int32)
    else:
        topk_length = np.where(rng.random(T) < full_rows, K, rng.integers(1, K + 1, T)).astype(np.int32)
    idx = rng.integers(0, S, (T, K)).astype(np.int32)
    idx[np.arange(K)[None, :] >= topk_length[:, None]] = -1
    sink = rng.standard_normal(H)
    return q, kv, idx, sink, topk_length, int(topk_length.sum())
