"""A JAX DeepSeek-V4 model on the dsv4-prefill attention path.

* `config`: `ModelConfig` (hyper-parameters, presets, config.json parsing).
* `layers`: linear, RMSNorm, RoPE, mHC, MoE.
* `attention`: one attention layer: caches, compressors, indexer, the sparse prefill call.
* `model`: `DeepseekV4`, one ragged step at a time.
* `checkpoint`: safetensors checkpoints (the official FP8/FP4 release, transformers' names) into
  the parameter tree, streamed from memory-mapped files onto the devices (NumPy + ml_dtypes).
* `names`: DeepSeek's and transformers' tensor names, mapped onto each other.
* `safetensors_io`: the header parser and memory-mapped reader (no torch, no safetensors package).
* `quant`: `QuantizedWeight` (FP8 / FP4 block-scaled weights on the device) and its dequantization.
* `parallel`: where each weight lives on a mesh (tensor / expert / vocabulary / storage splits).
* `generate`: `JaxGenerator`, continuous-batching greedy generation (V4 and V4.1 checkpoints).
* `v41_config`, `v41_attention`, `v41`, `v41_checkpoint`, `engram`: DeepSeek-V4.1 (`V41Config`,
  `DeepseekV41`): shared compressed caches, Reuse / Reindex indexers, the two-level top-k,
  single-pass mHC, Engram, transformers' fake quantization, decoder bounded replay.
"""

from dsv4_jax.model.config import ModelConfig, RopeConfig
from dsv4_jax.model.generate import JaxGenerator
from dsv4_jax.model.model import DeepseekV4, StepOutput, compile_counts
from dsv4_jax.model.quant import QuantizedWeight
from dsv4_jax.model.v41 import DeepseekV41
from dsv4_jax.model.v41_config import V41Config

__all__ = [
    "DeepseekV4",
    "DeepseekV41",
    "V41Config",
    "JaxGenerator",
    "ModelConfig",
    "QuantizedWeight",
    "RopeConfig",
    "StepOutput",
    "compile_counts",
]
