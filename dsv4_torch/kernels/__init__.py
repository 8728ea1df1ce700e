"""One file per sparse-attention kernel: `reference` (torch), `triton_sparse`, `flashmla`.

Nothing is imported here, so `import dsv4_torch` never pulls in Triton or the FlashMLA wheel.
"""
