"""`python -m dsv4_cpu build`: build the CPU kernels (and, for each installed framework, its binding)
ahead of time, e.g. in a container image; `python -m dsv4_cpu info`: what is built and what runs."""

from __future__ import annotations

import argparse
import importlib.util
import sys


def _frameworks(names: list[str] | None) -> list[str]:
    if names:
        return names
    return [n for n in ("torch", "jax") if importlib.util.find_spec(n) is not None]


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
        print(f"best (bf16): {binding.best_isa()}")
        return 0
    try:
        print(build.build_kernels())
        for fw in _frameworks(args.framework):
            if fw == "torch":
                from dsv4_torch.kernels.cpu import library as cpu

                print(cpu.torch_parallel_library())
            else:
                from dsv4_jax.kernels.cpu import library as cpu

                print(cpu.ffi_library())
    except RuntimeError as e:
        print(f"python -m dsv4_cpu build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
