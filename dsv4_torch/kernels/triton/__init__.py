"""Backend "triton": our Triton kernels for CUDA/ROCm GPUs (CPU tensors under TRITON_INTERPRET=1).
See `dsv4_torch.kernels`. (`import triton` inside this folder is the Triton package: imports are absolute.)"""
