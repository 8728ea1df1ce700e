"""Fixtures and tools that serve tests, bench scripts, eval and demos; not part of the library.

* `tools.tiny_checkpoint`: tiny random DeepSeek-V4 checkpoints (NumPy + safetensors, no torch):
  `python -m tools.tiny_checkpoint --out DIR`.
* `tools.aot`: lower JAX programs for CUDA on a machine without a GPU, and the Triton IR of the
  Pallas kernel (needs jax).
* `tools.triton_compile`: compile Triton IR / PTX offline with the `triton` wheel and read ptxas'
  resource report (needs triton, nothing else).
* `tools.transformers_suite` (+ `suite_plugin`): transformers' own DeepSeek-V4 model tests run
  against our path (`make test-transformers-suite`).
* `tools.grad_parity`: gradients of our path vs eager on the tiny checkpoint.

Run from the repository root (`python -m tools.NAME`, or pytest, whose `pythonpath` is the root);
the package is not installed with `pip install`.
"""
