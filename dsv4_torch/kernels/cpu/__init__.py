"""Backend "cpu": our C/C++ library (`dsv4_cpu`) on CPU tensors, on torch's threads. See `dsv4_torch.kernels`."""
