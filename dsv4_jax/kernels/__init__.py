"""The JAX kernels: one folder per backend, named as the backend table (`dsv4_jax.backends`) names it.

* `xla/`: plain jnp / lax on any platform, the reference: `attention.py` (the tiled sparse
  attention), `kvcache.py` (the fp8_ds_mla codec, writer and gather), `indexer.py` (the Lightning
  Indexer's top-k).
* `cpu/`: our C/C++ library (`dsv4_cpu`) as XLA FFI calls on XLA's threads: `library.py`
  (registration, checks, no backward), `attention.py` (flat contract and the per-layer prefill
  call), `kvcache.py` (the fp8_ds_mla gathers), `indexer.py` (the fused indexer), `prefill.py`
  (the layer call that replaces the chunk loop).
* `triton/`: Pallas kernels lowered through Triton on NVIDIA GPUs (`interpret=True`: Pallas'
  interpreter, any platform): `attention.py`, `kvcache.py`.
* `mosaic_gpu/`: a Pallas Mosaic GPU kernel for Hopper, jax >= 0.12 (GPU interpret mode on CPU):
  `attention.py`.
* `mosaic_tpu/`: Pallas TPU kernels (TPU interpret mode on CPU; libtpu compiles them from here):
  `attention.py` (the flat contract, chip targets), `prefill.py` (one layer per query tile
  straight from the caches), `rows.py` (the DMA machinery both share), `tile.py` (the prefill
  kernel's per-tile body).

The rule for references: a framework's reference kernels are its backend named "xla" (JAX) /
"reference" (torch), in that backend's folder, one file per operation like every other backend;
the float64 oracles every backend is tested against live in `planner/` (`oracle`,
`indexer_oracle`, `kvcache`). The torch twin is `dsv4_torch.kernels` (same file names per backend).

`dsv4_jax.sparse_attention`, `dsv4_jax.kvcache`, `dsv4_jax.indexer` and the prefill choose between
them through `dsv4_jax.backends`, the only place a backend name becomes a callable.
"""
