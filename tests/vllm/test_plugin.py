"""The plugin is found and loaded by vLLM's own loader, patches only what it says, refuses others."""

import os
import subprocess
import sys
from importlib.metadata import entry_points, version

from dsv4_torch.vllm import plugin

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str) -> str:
    """Python code in a fresh interpreter (this one has vLLM imported already)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_installed_vllm_is_a_checked_version():
    assert plugin.is_supported(version("vllm")), f"tests/vllm ran on vLLM {version('vllm')}"


def test_entry_point_is_registered():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "dsv4_prefill"]
    assert ep.value == "dsv4_torch.vllm.plugin:register"
    assert ep.load() is plugin.register


def test_vllm_loader_patches_plan_method(sparse_swa, vllm_plan):
    from dsv4_torch.vllm import chunk_plan

    method = sparse_swa.DeepseekSparseSWAMetadata.get_prefill_chunk_plan
    assert method is chunk_plan.get_prefill_chunk_plan
    assert vllm_plan.__module__ == sparse_swa.__name__ and vllm_plan.__qualname__.endswith("get_prefill_chunk_plan")


def test_consumers_guarded_when_imported(vllm_plugins):
    import vllm.models.deepseek_v4.nvidia.flashmla as v40
    import vllm.models.deepseek_v41.nvidia.flashmla as v41

    for cls in (v40.DeepseekV4FlashMLAAttention, v41.DeepseekV4FlashMLAAttention):
        assert plugin.original(cls._forward_prefill) is not None
    # The ROCm consumers are patched the same way when vLLM imports them; their modules initialise
    # a GPU at import time, so they cannot be imported on this CPU machine.


def test_package_import_imports_no_vllm_and_loader_is_lazy():
    """Importing our package loads no vLLM code; after vLLM's loader ran, vLLM's modules are
    patched when vLLM imports them (not before)."""
    out = _run(
        "import sys, dsv4_torch.vllm, dsv4_torch.vllm.plugin\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
        "import vllm.plugins; vllm.plugins.load_general_plugins()\n"
        "from dsv4_torch.vllm import _import_hooks\n"
        "mod = 'vllm.v1.attention.backends.mla.sparse_swa'\n"
        "print(mod in sys.modules, mod in _import_hooks.pending())\n"
        "import vllm.v1.attention.backends.mla.sparse_swa as s\n"
        "print(s.DeepseekSparseSWAMetadata.get_prefill_chunk_plan.__module__, mod in _import_hooks.pending())\n"
    )
    lines = out.strip().splitlines()
    assert lines[-3] == "[]"
    assert lines[-2] == "False True"
    assert lines[-1] == "dsv4_torch.vllm.chunk_plan False"


# The vLLM-free logic (version checks, modes, the signature guard) is tested in the default run:
# tests/torch/test_vllm_plugin.py.
