"""The torch kernels: one folder per backend, named as the backend table (`dsv4_torch.backends`) names it.

* `reference/`: plain torch, any device, the only backend with a backward pass and dropout:
  `attention.py` (the tiled sparse attention), `kvcache.py` (the fp8_ds_mla writer, gather and
  slot codec), `indexer.py` (the Lightning Indexer's top-k).
* `cpu/`: our C/C++ library (`dsv4_cpu`) on torch's threads: `library.py` (loading, torch's
  parallel-for), `attention.py` (flat contract and the per-layer prefill call), `kvcache.py` (the
  fp8_ds_mla gather), `indexer.py` (the fused indexer), `prefill.py` (the layer call that
  replaces the chunk loop).
* `triton/`: our Triton kernels for CUDA/ROCm (CPU tensors under TRITON_INTERPRET=1):
  `attention.py` (sparse attention), `kvcache.py` (fp8_ds_mla insert and gather), `gather.py`
  (the prefill's gather of rows in q's dtype).
* `flashmla/`: the FlashMLA wheel (`sgl-flash-mla`) on SM90/SM100: `attention.py`.

The rule for references: a framework's reference kernels are its backend named "reference"
(torch) / "xla" (JAX), in that backend's folder, one file per operation like every other
backend; the float64 oracles every backend is tested against live in `planner/` (`oracle`,
`indexer_oracle`, `kvcache`). The JAX twin is `dsv4_jax.kernels` (same file names per backend).

Nothing is imported here, so `import dsv4_torch` never pulls in Triton or the FlashMLA wheel;
`dsv4_torch.backends` is the only place a backend name becomes a callable.
"""
