"""`python -m dsv4_cpu info` and `binding.kernel_isas`: which instruction set each kernel runs,
whether it multiplies bf16 natively, and whether the frameworks' bf16 GEMM is native here."""

from __future__ import annotations

import subprocess
import sys

from dsv4_cpu import binding

RUNNABLE = [i for i, ok in binding.isa_supported().items() if ok]
KERNELS = {"attention bf16", "attention float32", "indexer fp8", "indexer bf16", "indexer float32"}


def test_kernel_isas_follow_the_cap(monkeypatch):
    monkeypatch.delenv("DSV4_PREFILL_CPU_ISA", raising=False)
    k = binding.kernel_isas()
    assert set(k) == KERNELS
    assert k["attention bf16"]["isa"] == binding.best_isa(binding.BF16)
    assert k["attention bf16"]["bf16_dot"] == ("avx512bf16" in RUNNABLE)
    assert not k["attention float32"]["bf16_dot"] and not k["indexer float32"]["bf16_dot"]
    for isa in RUNNABLE:
        monkeypatch.setenv("DSV4_PREFILL_CPU_ISA", isa)
        k = binding.kernel_isas()
        assert all(binding.ISAS.index(v["isa"]) <= binding.ISAS.index(isa) for v in k.values()), (isa, k)
        assert k["attention float32"]["isa"] == ("avx512" if isa == "avx512bf16" else isa)
        assert all(v["bf16_dot"] == (v["isa"] == "avx512bf16" and "float32" not in n) for n, v in k.items())


def test_bf16_matmul_native_reads_the_flags():
    assert binding.bf16_matmul_native("flags : fpu avx2 fma") is False
    assert binding.bf16_matmul_native("flags : fpu avx2 avx512f avx512_bf16") is True
    assert binding.bf16_matmul_native("flags : fpu avx2 amx_bf16 amx_tile") is True


def test_info_names_each_kernel():
    res = subprocess.run([sys.executable, "-m", "dsv4_cpu", "info"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    for name in KERNELS:
        assert name in res.stdout
    assert "bf16 GEMM in torch / XLA: " + ("native" if binding.bf16_matmul_native() else "EMULATED") in res.stdout
