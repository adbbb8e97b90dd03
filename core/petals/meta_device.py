"""Building modules on the meta device without the imports torch's Python reference ops bring."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class NoReferenceOpsOnMeta(TorchFunctionMode):
    """On the meta device torch runs some functions through its Python reference ops, whose first use
    imports sympy (30 MiB, 0.4 s of a client's start). In this thread: ``torch.nn.init`` leaves a meta
    tensor as it is (it holds no values to set) and ``torch.arange`` without a device makes its (small)
    range on the CPU, so that buffers computed from it (rotary frequencies) hold their values at once.
    ``torch.cat`` of such a CPU range and a meta tensor (a rotary embedding that pads its frequencies with
    zeros made without a device) gives a meta tensor, as the range would have been without this mode:
    the buffer is computed later, and torch would otherwise refuse the mixed devices."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        elif func is torch.arange and kwargs.get("device") is None:
            kwargs["device"] = "cpu"
        elif func is torch.cat and args and _mixes_meta(args[0]):
            args = ([tensor.to("meta") for tensor in args[0]], *args[1:])
        return func(*args, **kwargs)


def _mixes_meta(tensors: Any) -> bool:
    devices = {tensor.is_meta for tensor in tensors if isinstance(tensor, torch.Tensor)}
    return devices == {True, False}
