"""Hardware acceptance runs: one short prepared run per accelerator, for when one is lent.

* GPU (H100/H200/B200): `python -m bench.gpu_check` runs them all, each in its own process with
  its own time cap: `gpu_torch` (FlashMLA and our Triton kernel vs the reference), `gpu_jax`
  (Mosaic GPU and Pallas-Triton vs xla), `gpu_prefill` (whole prefill layers, every plan, both
  frameworks), `gpu_model` (one V4-Flash-sized layer in the official FP8/FP4 format),
  `gpu_kvcache` (vLLM's fp8_ds_mla pages on the GPU).
* TPU: `python -m bench.checks.tpu` (the kernels vs xla on a TPU; without one, a cost model).
* Without a GPU: `triton_resources_torch` / `triton_resources_jax` compile the Triton kernels for
  a GPU architecture and report registers, spills and shared memory.

The benchmarks (speed and memory against peers and the machine's ceiling) are the other modules
of `bench/`.
"""
