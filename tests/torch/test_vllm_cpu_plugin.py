"""The plugin's vLLM-cpu dispatch without vLLM: version gate, the CPU check, the prefill switch."""

import logging

import pytest

from dsv4_torch.vllm import plugin
from dsv4_torch.vllm.cpu import engine as cpu_engine


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    installed = []
    monkeypatch.setattr(cpu_engine, "install", lambda: installed.append(True))
    return monkeypatch, installed


def test_unchecked_vllm_cpu_is_refused(fresh, caplog):
    mp, installed = fresh
    mp.setattr(plugin, "vllm_cpu_version", lambda: "0.33.0")
    with caplog.at_level(logging.WARNING, logger="vllm.dsv4_prefill"):
        assert plugin.register() is False
    assert "vllm-cpu 0.32.0 only, found vllm-cpu 0.33.0" in caplog.text and not installed
    mp.setenv(plugin.ENV_VAR, "require")
    with pytest.raises(plugin.UnsupportedVLLMVersionError, match="found vllm-cpu 0.33.0"):
        plugin.register()


def test_checked_vllm_cpu_installs_where_the_kernels_run(fresh):
    mp, installed = fresh
    mp.setattr(plugin, "vllm_cpu_version", lambda: "0.32.0")
    mp.setattr(cpu_engine, "cpu_features", lambda: {"amx": False, "avx512bf16": True})
    mp.setattr("platform.machine", lambda: "x86_64")
    assert plugin.register() is True and installed == [True]
    assert cpu_engine.needs_unlock()


def test_a_cpu_without_the_kernels_is_refused(fresh, caplog):
    mp, installed = fresh
    mp.setattr(plugin, "vllm_cpu_version", lambda: "0.32.0")
    mp.setattr(cpu_engine, "cpu_features", lambda: {"amx": False, "avx512bf16": False})
    mp.setattr("platform.machine", lambda: "x86_64")
    with caplog.at_level(logging.WARNING, logger="vllm.dsv4_prefill"):
        assert plugin.register() is False
    assert "neither AMX nor AVX512-BF16" in caplog.text and not installed
    mp.setenv(plugin.ENV_VAR, "require")
    with pytest.raises(cpu_engine.CPUPathUnavailableError, match="AVX512-BF16"):
        plugin.register()


def test_off_installs_nothing(fresh):
    mp, installed = fresh
    mp.setattr(plugin, "vllm_cpu_version", lambda: "0.32.0")
    mp.setenv(plugin.ENV_VAR, "off")
    assert plugin.register() is False and not installed


def test_prefill_kernel_switch(monkeypatch):
    monkeypatch.delenv(cpu_engine.PREFILL_ENV, raising=False)
    assert cpu_engine.prefill_kernel() == "dsv4"
    monkeypatch.setenv(cpu_engine.PREFILL_ENV, " VLLM ")
    assert cpu_engine.prefill_kernel() == "vllm"
    monkeypatch.setenv(cpu_engine.PREFILL_ENV, "dsv4-attention")
    assert cpu_engine.prefill_kernel() == "dsv4-attention"
    monkeypatch.setenv(cpu_engine.PREFILL_ENV, "flash")
    with pytest.raises(ValueError, match="DSV4_PREFILL_VLLM_CPU_PREFILL.*'flash'"):
        cpu_engine.prefill_kernel()


@pytest.mark.parametrize("kernel", ["vllm", "dsv4-attention"])
def test_indexer_runs_vllms_own_unless_dsv4(kernel):
    """Prefill kernels "vllm" and "dsv4-attention" keep vLLM's forward_cpu for the indexer (timed
    into STATS["vllm_indexer_seconds"]); "dsv4" reads the step's metadata for our kernel."""
    from dsv4_torch.vllm.cpu import attention as cpu_attention
    from dsv4_torch.vllm.cpu.indexer import make_forward_cpu

    calls = []
    fwd = make_forward_cpu(lambda *a: calls.append(a) or "theirs", lambda: kernel)
    before = cpu_attention.STATS["vllm_indexer_seconds"]
    assert fwd("layer", "h", "q", "k", "w") == "theirs" and calls == [("layer", "h", "q", "k", "w")]
    assert cpu_attention.STATS["vllm_indexer_seconds"] > before
