"""Backend "flashmla": the FlashMLA wheel (`sgl-flash-mla`) on SM90/SM100 GPUs. See `dsv4_torch.kernels`."""
