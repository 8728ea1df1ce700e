"""A JAX DeepSeek-V4 model on the dsv4-prefill attention path.

* `config`: `ModelConfig` (hyper-parameters, presets, config.json parsing).
* `layers`: linear, RMSNorm, RoPE, mHC, MoE.
* `attention`: one attention layer: caches, compressors, indexer, the sparse prefill call.
* `model`: `DeepseekV4`, one ragged step at a time.
* `checkpoint`: safetensors checkpoints into the parameter tree (NumPy only).
* `generate`: `JaxGenerator`, continuous-batching greedy generation.
"""

from dsv4_jax.model.config import ModelConfig, RopeConfig
from dsv4_jax.model.generate import JaxGenerator
from dsv4_jax.model.model import DeepseekV4, StepOutput, compile_counts

__all__ = ["DeepseekV4", "JaxGenerator", "ModelConfig", "RopeConfig", "StepOutput", "compile_counts"]
