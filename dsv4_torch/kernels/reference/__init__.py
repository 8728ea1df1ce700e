"""Backend "reference": plain torch on any device (attention with a backward and dropout, the
fp8_ds_mla cache functions, the indexer's top-k). See `dsv4_torch.kernels`."""
