"""`python -m dsv4_cpu build`: build the CPU kernels (and, for each installed framework, its binding)
ahead of time, e.g. in a container image; `python -m dsv4_cpu info`: what is built and what runs.

The library knows no framework: each framework package registers the builder of its binding as
an entry point of group `dsv4_cpu.bindings` (pyproject.toml: torch's parallel-for library,
`dsv4_torch.kernels.cpu.library:torch_parallel_library`; JAX's FFI handlers,
`dsv4_jax.kernels.cpu.library:ffi_library`), and `build` calls those of the frameworks installed."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys

GROUP = "dsv4_cpu.bindings"


def bindings() -> dict:
    """Framework name -> the entry point of its binding's builder (registered, framework installed)."""
    eps = importlib.metadata.entry_points(group=GROUP)
    return {ep.name: ep for ep in sorted(eps, key=lambda e: e.name) if importlib.util.find_spec(ep.name) is not None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_cpu", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the kernels and the bindings of the installed frameworks")
    b.add_argument("--framework", action="append", choices=("torch", "jax"), help="only these (repeatable)")
    sub.add_parser("info", help="print the cache, the libraries and the instruction sets this machine runs")
    args = ap.parse_args(argv)

    from dsv4_cpu import binding, build

    if args.command == "info":
        print(f"cache: {build.cache_dir()}")
        print(f"kernels: {build.build_kernels()}")
        print(
            "instruction sets: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in binding.isa_supported().items())
        )
        from dsv4_cpu.build import cpu_flags

        if "amx_bf16" in cpu_flags().split():
            print("  (this CPU has AMX-BF16; the library has no AMX kernel yet, so amx=no)")
        print("kernels run (DSV4_PREFILL_CPU_ISA caps the choice):")
        for name, k in binding.kernel_isas().items():
            how = (
                "bf16 dot products"
                if k["bf16_dot"]
                else "float32 FMAs" + ("" if name.endswith("float32") else " (inputs widened)")
            )
            print(f"  {name:<18} {k['isa']:<11} {how}")
        if binding.bf16_matmul_native():
            print("bf16 GEMM in torch / XLA: native (the CPU has AVX512-BF16 or AMX-BF16)")
        else:
            print(
                "bf16 GEMM in torch / XLA: EMULATED, no AVX512-BF16 or AMX-BF16 (torch's 2048^3 bf16 matmul ran at "
                "0.3 GFLOP/s against 132 for float32 on a Zen 3): run models and references in float32 here; "
                "our kernels above take bf16 inputs at float32 speed"
            )
        print(f"bindings registered ({GROUP}): {', '.join(bindings()) or 'none'}")
        return 0
    found = bindings()
    missing = [fw for fw in args.framework or () if fw not in found]
    if missing:
        print(
            f"python -m dsv4_cpu build: no binding registered for {', '.join(missing)} (entry points {GROUP!r}: "
            "install the project, `pip install -e .`, and the framework)",
            file=sys.stderr,
        )
        return 2
    try:
        print(build.build_kernels())
        for fw in args.framework or list(found):
            print(found[fw].load()())
    except RuntimeError as e:
        print(f"python -m dsv4_cpu build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
