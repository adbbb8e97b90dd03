"""Weights held in the encoding their checkpoint stores, dequantized where they are used.

A ``PackedWeight`` is a module whose buffers are a weight's stored parts (FP8 codes and their scales,
GGUF blocks, int4 codes and group scales, ...); it stands where the block's dense parameter stood,
under the same name (``q_proj.weight``, ``experts.gate_up_proj``), so the block's own transformers code
runs unchanged:

- ``F.linear(x, weight)`` (every ``nn.Linear``) calls the weight's ``linear``: a kernel where the
  format has one for the device (torch's CPU int4 matmul for 4-bit integer codes), else the weight
  dequantized in the serving dtype for this call only;
- ``weight[e]`` (transformers' eager experts loop, one routed expert at a time) dequantizes expert
  ``e`` alone, so an MoE step dequantizes only the experts it routes to;
- any other torch function given the weight (``torch.bmm`` over all experts) sees it dequantized;
- ``torch.stack`` and ``torch.cat`` (transformers' checkpoint conversions fusing per-expert
  linears into 3-D experts, gate and up into one) build a packed weight of the parts, still packed.

Dequantizing is the format's own (``dequantize``, ``expert``), the same function at load
(``--weights dequantized``) and per forward, so both give the same weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class PackedWeight(nn.Module):
    """A 2-D weight ``[out, in]`` or a 3-D stack of experts ``[experts, ...]`` in its stored encoding.

    Subclasses register their stored parts as buffers (so moves, ``state_dict`` and
    ``block_weight_bytes`` see them) and implement ``dequantize``; 3-D ones also ``expert``.
    ``dtype`` is what the weight dequantizes to: the serving dtype.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        super().__init__()
        self.shape, self.dtype = torch.Size(shape), dtype

    # --- what a subclass provides ---------------------------------------------------------------

    def dequantize(self) -> torch.Tensor:
        """The whole weight in ``self.dtype`` on the weight's device."""
        if self.ndim == 3:
            return torch.stack([self.expert(index) for index in range(self.shape[0])])
        raise NotImplementedError

    def expert(self, index: int) -> torch.Tensor:
        """Expert ``index`` of a 3-D weight, dequantized alone."""
        return self.dequantize()[index]

    def expert_weight(self, index: int) -> torch.Tensor | PackedWeight:
        """Expert ``index`` as ``weight[e]`` gives it: still packed where a kernel computes with it
        (``kernel``: transformers' experts loop passes it to ``F.linear``, which calls its ``linear``),
        else dequantized (``expert``)."""
        return self.expert(index)

    kernel = False  # whether ``linear`` computes with the packed weight (some inputs, some devices)

    def linear(self, inputs: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(inputs, weight, bias)``: the dequantized weight, unless a subclass has a kernel.
        Where autograd records the step (a backward pass through the block), the weight is dequantized
        again for the backward rather than kept alive in the graph."""
        if torch.is_grad_enabled() and inputs.requires_grad:
            return _RecomputedLinear.apply(inputs, bias, self)
        return F.linear(inputs, self.dequantize().to(inputs.dtype), bias)

    # --- what every packed weight is --------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def device(self) -> torch.device:
        return next(iter(self.stored_tensors()), torch.empty(0)).device

    @property
    def is_meta(self) -> bool:
        return any(tensor.is_meta for tensor in self.stored_tensors())

    @property
    def requires_grad(self) -> bool:
        return False

    def stored_tensors(self) -> Iterable[torch.Tensor]:
        return (tensor for _, tensor in self.named_buffers())

    @property
    def stored_nbytes(self) -> int:
        """Bytes of the stored parts, as held now."""
        return sum(tensor.nbytes for tensor in self.stored_tensors())

    def __getitem__(self, index) -> torch.Tensor:
        if self.ndim == 3 and (isinstance(index, int) or (torch.is_tensor(index) and index.ndim == 0)):
            return self.expert_weight(int(index))
        return self.dequantize()[index]

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, dtype={str(self.dtype).removeprefix('torch.')}"

    def _apply(self, fn, recurse=True):
        """Moves keep the stored dtypes: a float32 scale must not become bfloat16 with the block."""
        for name, tensor in self._buffers.items():
            if tensor is not None:
                moved = fn(tensor)
                self._buffers[name] = moved if moved.dtype == tensor.dtype else tensor.to(moved.device)
        for module in self.children():
            module._apply(fn, recurse)
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.stack, torch.cat, torch.concat, torch.concatenate):
            return _joined(func, *args, **kwargs)
        if func is F.linear:
            inputs, weight, *rest = args
            if isinstance(weight, PackedWeight) and not isinstance(inputs, PackedWeight):
                bias = rest[0] if rest else kwargs.get("bias")
                return weight.linear(inputs, bias)
        return func(*_dense(args), **_dense(kwargs))


class _RecomputedLinear(torch.autograd.Function):
    """``F.linear`` over a packed weight that autograd does not save: the graph of a backward pass would
    otherwise hold a dequantized copy of every weight until the backward runs. Weights are frozen:
    gradients flow to the inputs only."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, bias: torch.Tensor | None, weight: PackedWeight) -> torch.Tensor:
        ctx.weight = weight
        return F.linear(inputs, weight.dequantize().to(inputs.dtype), bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        dense = ctx.weight.dequantize().to(grad_output.dtype)
        return grad_output @ dense, None, None


def _dense(value):
    """``value`` with every packed weight in it dequantized (lists, tuples and dicts searched)."""
    if isinstance(value, PackedWeight):
        return value.dequantize()
    if isinstance(value, (list, tuple)):
        return type(value)(_dense(item) for item in value)
    if isinstance(value, dict):
        return {key: _dense(item) for key, item in value.items()}
    return value


def _joined(func: Callable, tensors: Sequence, dim: int = 0, **kwargs) -> PackedWeight:
    """``torch.stack`` / ``torch.cat`` of weights of which at least one is packed: still packed."""
    if kwargs.get("out") is not None:
        raise TypeError("packed weights cannot be joined into out=")
    parts = [part if isinstance(part, PackedWeight) else DenseWeight(part) for part in tensors]
    ndim = parts[0].ndim + (1 if func is torch.stack else 0)
    dim = dim % ndim
    if func is torch.stack:
        if dim != 0:
            raise NotImplementedError(f"packed weights stack along dim 0 (experts), not {dim}")
        return StackedWeight(parts)
    return ConcatenatedWeight(parts, dim)


class DenseWeight(PackedWeight):
    """A plain tensor among packed ones (an expert stored unquantized, say)."""

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        super().__init__(tensor.shape, dtype or tensor.dtype)
        self.register_buffer("tensor", tensor)

    def dequantize(self) -> torch.Tensor:
        return self.tensor.to(self.dtype)

    def expert(self, index: int) -> torch.Tensor:
        return self.tensor[index].to(self.dtype)


class StackedWeight(PackedWeight):
    """Experts stored one matrix each (``experts.0.gate_proj.weight``, ...), stacked along dim 0."""

    def __init__(self, parts: Sequence[PackedWeight]) -> None:
        shapes = {part.shape for part in parts}
        if len(shapes) != 1:
            raise ValueError(f"stacked experts differ in shape: {sorted(map(tuple, shapes))}")
        super().__init__((len(parts), *parts[0].shape), parts[0].dtype)
        self.parts = nn.ModuleList(parts)

    def expert(self, index: int) -> torch.Tensor:
        return self.parts[index].dequantize()

    def expert_weight(self, index: int) -> torch.Tensor | PackedWeight:
        part = self.parts[index]
        return part if part.kernel else self.expert(index)


class ConcatenatedWeight(PackedWeight):
    """Weights joined along ``dim`` (gate and up rows into one ``gate_up_proj``)."""

    def __init__(self, parts: Sequence[PackedWeight], dim: int) -> None:
        shape = list(parts[0].shape)
        shape[dim] = sum(part.shape[dim] for part in parts)
        super().__init__(shape, parts[0].dtype)
        self.parts, self.dim = nn.ModuleList(parts), dim

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts], dim=self.dim)

    def expert(self, index: int) -> torch.Tensor:
        if self.dim == 0:
            raise IndexError(
                "experts of a weight concatenated along the experts are not addressed one by one"
            )
        return torch.cat([part.expert(index) for part in self.parts], dim=self.dim - 1)

    def expert_weight(self, index: int) -> torch.Tensor | PackedWeight:
        if self.dim == 0:
            return self.expert(index)
        parts = [part.expert_weight(index) for part in self.parts]
        if all(isinstance(part, PackedWeight) for part in parts):
            return ConcatenatedWeight(parts, self.dim - 1)
        return torch.cat([_dense(part) for part in parts], dim=self.dim - 1)

    @property
    def kernel(self) -> bool:
        return self.ndim == 2 and self.dim == 0 and all(part.kernel for part in self.parts)

    def linear(self, inputs: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Rows joined (gate and up): each part's own ``linear``, outputs side by side."""
        if not self.kernel:
            return super().linear(inputs, bias)
        biases = [None] * len(self.parts) if bias is None else bias.split([p.shape[0] for p in self.parts])
        return torch.cat([part.linear(inputs, b) for part, b in zip(self.parts, biases, strict=True)], dim=-1)


def set_dtype(weight: PackedWeight, dtype: torch.dtype) -> None:
    """Make ``weight`` (and its parts) dequantize to ``dtype``."""
    for module in weight.modules():
        if isinstance(module, PackedWeight):
            module.dtype = dtype


def install_weights(block: nn.Module, state_dict: dict[str, torch.Tensor | PackedWeight]) -> None:
    """Fill ``block`` (built on the meta device) with ``state_dict``, whose names and shapes are the
    block's own: plain tensors are assigned as parameters and buffers, packed weights replace the
    parameter of their name."""
    packed = {name: value for name, value in state_dict.items() if isinstance(value, PackedWeight)}
    block.load_state_dict(
        {name: value for name, value in state_dict.items() if name not in packed}, strict=False, assign=True
    )
    for name, weight in packed.items():
        owner_name, _, attribute = name.rpartition(".")
        owner = block.get_submodule(owner_name)
        del owner._parameters[attribute]
        owner.add_module(attribute, weight)
        if weight.ndim == 3:
            routed_one_by_one(owner)


def routed_one_by_one(experts: nn.Module) -> None:
    """Run ``experts`` with transformers' eager loop, which takes one routed expert's weights at a time
    (``weight[e]``): the batched implementations take every expert's, which packed experts would
    dequantize whole. Its config becomes its own copy, so the block's other modules keep theirs."""
    config = getattr(experts, "config", None)
    if config is not None and getattr(config, "_experts_implementation", None) not in (None, "eager"):
        experts.config = copy.copy(config)
        experts.config._experts_implementation = "eager"


def packed_weights(module: nn.Module) -> dict[str, PackedWeight]:
    """The outermost packed weights of ``module`` by name."""
    found: dict[str, PackedWeight] = {}
    for name, child in module.named_modules():
        if isinstance(child, PackedWeight) and not any(name.startswith(outer + ".") for outer in found):
            found[name] = child
    return found


def dequantize_in_place(module: nn.Module) -> None:
    """Replace every packed weight of ``module`` by its dequantized parameter (``--weights dequantized``,
    and what tensor parallelism or adapters need)."""
    for name, weight in packed_weights(module).items():
        owner_name, _, attribute = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        dense = weight.dequantize()
        del owner._modules[attribute]
        owner.register_parameter(attribute, nn.Parameter(dense, requires_grad=False))
