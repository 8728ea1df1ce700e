"""The CPU benches' ceiling (`bench.common.cpu_ceiling`): one matmul, of the dtype our kernels run
in here, and capped to the instruction set DSV4_PREFILL_CPU_ISA forces (a child process with
MKL / oneDNN capped alike), so a forced AVX2 run reads against an AVX2 machine's matmul."""

from __future__ import annotations

import pytest

from bench import common
from dsv4_cpu import binding

RUNNABLE = [i for i, ok in binding.isa_supported().items() if ok and i in common.GEMM_CAPS]


def test_dtype_follows_the_attention_kernel(monkeypatch):
    monkeypatch.delenv("DSV4_PREFILL_CPU_ISA", raising=False)
    want = "bf16" if binding.best_isa(binding.BF16) == "avx512bf16" else "fp32"
    assert common.cpu_ceiling_dtype() == want
    for isa in RUNNABLE:
        monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", isa)
        assert common.cpu_ceiling_dtype() == ("bf16" if isa == "avx512bf16" else "fp32")


def test_uncapped_ceiling_runs_in_process(monkeypatch):
    monkeypatch.delenv("DSV4_PREFILL_CPU_ISA", raising=False)
    c = common.cpu_ceiling(1, repeats=1, n=128)
    assert c["capped"] is False and c["isa"] == binding.best_isa(binding.BF16) and c["gflops"] > 0
    assert c["dtype"] in common.describe_ceiling(c)


@pytest.mark.skipif(len(RUNNABLE) < 2, reason="this CPU runs one instruction set only: nothing to cap")
def test_forced_set_caps_the_gemm_in_a_child(monkeypatch):
    isa = RUNNABLE[-2]  # one below the machine's best
    monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", isa)
    c = common.cpu_ceiling(1, repeats=1, n=128)
    assert c["capped"] is True and c["isa"] == isa and c["dtype"] == "fp32" and c["gflops"] > 0
    assert f"capped to {isa}" in common.describe_ceiling(c)


def test_bad_threads():
    with pytest.raises(ValueError, match="threads.*0"):
        common.cpu_ceiling(0)


def test_ceiling_call_times_the_same_matmul_in_process(monkeypatch):
    monkeypatch.delenv("DSV4_PREFILL_CPU_ISA", raising=False)
    c = common.cpu_ceiling(1, repeats=1, n=64)
    call, flop = common.ceiling_call(c, 1, n=64)
    assert flop == 2.0 * 64**3
    out = call()
    assert (
        tuple(out.shape) == (64, 64)
        and str(out.dtype) == {"bf16": "torch.bfloat16", "fp32": "torch.float32"}[c["dtype"]]
    )
    assert common.ceiling_call(dict(c, capped=True), 1) == (None, 0.0)
