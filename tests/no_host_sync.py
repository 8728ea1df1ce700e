"""A CPU-side check that code would not block on the device: `with forbid_host_sync(): ...`.

On a GPU, reading a tensor's value on the host (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`) or an
op whose output size depends on the data (`nonzero`, boolean-mask indexing, `repeat_interleave`
without `output_size`) waits for every queued kernel. Such calls look harmless on CPU, so this mode
intercepts them at the torch-function level and raises, naming the op, whatever the device.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# Calls that read device values on the host, or whose output shape depends on device data.
_SYNCING = {
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "__format__",
    "__repr__",
}


class HostSyncError(AssertionError):
    pass


def _is_bool_tensor(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dtype == torch.bool
    if isinstance(x, (tuple, list)):
        return any(_is_bool_tensor(v) for v in x)
    return False


class forbid_host_sync(TorchFunctionMode):
    """Raise HostSyncError on any call that would make the host wait for the device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        bad = name in _SYNCING
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1:
            bad = _is_bool_tensor(args[1])  # boolean-mask indexing sizes its output from the data
        if name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            bad = kwargs.get("output_size") is None
        if bad:
            raise HostSyncError(f"host sync: torch call {name!r} would wait for the device")
        return func(*args, **kwargs)
