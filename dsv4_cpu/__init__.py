"""dsv4-prefill's native CPU library: one framework-free C/C++ library both frameworks call.

- `csrc/`: the sources. `dsv4_cpu.h` is the whole public C API: the sparse-attention kernel on a
  flat workspace (FlashMLA's contract), one prefill layer straight from the caches (rows or vLLM's
  fp8_ds_mla pages, dequantized inside the kernel), vLLM's fp8_ds_mla gather-dequantize, the
  Lightning Indexer's fused score-and-top-k (`indexer.cc`, DeepSeek-V4.1's two-level top-k in
  `indexer_two_level.cc`, per-ISA block kernels in `indexer_isa.cc`), and how a call runs on its host framework's threads (`dsv4_parallel`).
  `xla_ffi.cc` and `xla_indexer.cc` hold the XLA FFI handlers, `torch_parallel.cc` torch's
  parallel-for.
- `__main__`: `python -m dsv4_cpu build | info` (info: each kernel's instruction set here); the
  frameworks' bindings are found through the `dsv4_cpu.bindings` entry points, never imported.
- `build`: compiles the libraries once per machine into a cache only you can write
  (`python -m dsv4_cpu build` does it ahead of time).
- `binding`: the ctypes binding (torch's callers go through `dsv4_torch.kernels.cpu`; JAX's
  through `dsv4_jax.kernels.cpu`, which registers the FFI handlers).

No framework is imported here.
"""

from dsv4_cpu.binding import ISAS, KIND_CODES, best_isa, isa_supported, library, unavailable_reason

__all__ = ["ISAS", "KIND_CODES", "best_isa", "isa_supported", "library", "unavailable_reason"]
