"""Quantize a served block's weight matrices: int8 (LLM.int8()) or nf4, every matrix of every family.

One path, no family hook: every ``nn.Linear`` becomes ``bnb.nn.Linear8bitLt(has_fp16_weights=False,
threshold=6.0)`` or ``bnb.nn.Linear4bit`` (nf4, blocksize 64, compressed statistics), as in Petals;
every 3-D expert weight (transformers 5's fused ``gate_up_proj``/``down_proj``, which bitsandbytes
cannot quantize as modules) becomes a packed weight quantized one expert at a time (``Nf4Experts``:
bitsandbytes' nf4 with the same nested statistics; ``Int8Experts``: int8 codes with a float32 scale
per row), of which an MoE step dequantizes only the experts it routes to. A family's
``quantize_module`` hook still comes first, for a module it quantizes its own way. Linear weights
become quantized when the block moves to its device (``block.to(device)``, done here); expert weights
are quantized on the device. bitsandbytes is imported only when a block is quantized, never by
``import petals``.

``nbytes`` is what each scheme takes for a matrix of a given shape, with every tensor bitsandbytes
keeps: ``petals.convert.memory`` plans with it.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from petals.formats.packed import PackedWeight, routed_one_by_one
from petals.plugins import get_plugin_manager

NF4_BLOCK = 64  # weights per absmax
NF4_NESTED_BLOCK = 256  # absmaxes per nested float32 absmax
NF4_TABLES = 4 * (16 + 256)  # the nf4 code table and the nested absmax's code table, float32
NF4_STATE_JSON = 170  # bitsandbytes' packed quant_state description in a Linear4bit's state dict (bytes)


class QuantType(enum.StrEnum):
    NONE = "none"
    INT8 = "int8"  # 8-bit weights with fp outliers (LLM.int8()), ~2x smaller than fp16
    NF4 = "nf4"  # 4-bit NormalFloat, ~4x smaller than fp16


def nbytes(quant_type: QuantType | str, shape: Sequence[int]) -> int:
    """Bytes a weight of ``shape`` takes quantized: a 2-D linear as bitsandbytes' layer keeps it, 3-D
    experts as ``Nf4Experts``/``Int8Experts`` do."""
    *lead, rows, cols = shape
    experts, count = math.prod(lead), rows * cols
    absmaxes = math.ceil(count / NF4_BLOCK)
    nested = math.ceil(absmaxes / NF4_NESTED_BLOCK)
    if QuantType(quant_type) is QuantType.NF4:
        per_matrix = math.ceil(count / 2) + absmaxes + 4 * nested
        return (
            per_matrix + NF4_TABLES + NF4_STATE_JSON if not lead else experts * (per_matrix + 4) + NF4_TABLES
        )
    return experts * (count + 4 * rows) + (0 if lead else 1)  # int8 codes, a float32 scale per row


def is_router(module: nn.Module) -> bool:
    """An MoE router (transformers' ``*Router`` classes): small, and kept exact, as transformers keeps
    several families' in float32. Some are ``nn.Linear`` subclasses whose forward also routes,
    which a quantized linear put in their place would not do."""
    return type(module).__name__.endswith("Router")


def is_experts(module: nn.Module, parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` of ``module`` is a fused 3-D expert weight ``[experts, ...]``: a
    convolution's kernel (``[channels, 1, width]``, Mamba's, LFM2's, gated delta nets') is 3-D too, but
    no stack of matrices."""
    return (
        parameter.ndim == 3
        and parameter.is_floating_point()
        and not isinstance(module, nn.modules.conv._ConvNd)
    )


def kept_exact(block: nn.Module) -> Callable[[str, nn.Module], bool]:
    """Which submodules (by path in the block) quantization leaves as they are: routers (``is_router``)
    and what transformers keeps in float32 for the block's model (``_keep_in_fp32_modules``, such as
    GLM-5's indexer ``weights_proj``, whose input the layer casts to that weight's dtype), which
    transformers' own bitsandbytes integration does not convert either."""
    from petals.loading import kept_in_float32

    kept = kept_in_float32(type(block), torch.float16)
    return lambda path, module: is_router(module) or (kept is not None and kept.search(path) is not None)


def weight_matrices(block: nn.Module) -> Iterator[tuple[str, nn.Parameter, bool]]:
    """``(name, weight, is_experts)`` of each weight matrix that quantization and packed formats act on:
    the weights of ``nn.Linear`` modules and 3-D expert weights (``is_experts``), outside the modules
    ``kept_exact`` names. Norms, biases and convolutions are not among them."""
    yield from _weight_matrices(block, "", kept_exact(block))


def _weight_matrices(
    module: nn.Module, prefix: str, kept: Callable[[str, nn.Module], bool]
) -> Iterator[tuple[str, nn.Parameter, bool]]:
    for name, parameter in module.named_parameters(recurse=False):
        if is_experts(module, parameter):
            yield prefix + name, parameter, True
        elif isinstance(module, nn.Linear) and name == "weight":
            yield prefix + name, parameter, False
    for name, child in module.named_children():
        if not kept(prefix + name, child):
            yield from _weight_matrices(child, f"{prefix}{name}.", kept)


def quantize_block(
    block: nn.Module,
    quant_type: QuantType | str,
    compute_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Replace the block's weight matrices by quantized ones in place and move it to ``device``.

    ``compute_dtype`` is the dtype nf4 layers and quantized experts dequantize to (int8 linears compute
    in the input's dtype). Call this while the weights are still on CPU: linears quantize on the move.
    """
    quant_type = QuantType(quant_type)
    if quant_type is not QuantType.NONE:
        quantize_linear = _linear_quantizer(quant_type, compute_dtype)
        config = getattr(block, "config", None)
        offer = functools.partial(
            get_plugin_manager().family_hooks(config).quantize_module,
            config=config,
            quantize_linear=quantize_linear,
        )
        quantize_experts = functools.partial(
            Nf4Experts if quant_type is QuantType.NF4 else Int8Experts,
            dtype=compute_dtype,
            device=torch.device(device),
        )
        _replace_modules(block, "", kept_exact(block), offer, quantize_linear, quantize_experts)
    return block.to(device)


def _replace_modules(
    module: nn.Module,
    prefix: str,
    kept: Callable[[str, nn.Module], bool],  # kept_exact: routers, float32 modules
    offer: Callable[..., nn.Module | None],  # the family's quantize_module hook, called with module=
    quantize_linear: Callable[[nn.Linear], nn.Module],
    quantize_experts: Callable[[torch.Tensor], PackedWeight],
) -> None:
    """Quantize ``module``'s own 3-D weights (fused experts), then each child not ``kept``: a linear, what
    the family's hook answers for it (a module it returns is kept as it is), or its own weights and
    children (``weight_matrices`` names the same matrices)."""
    for name, parameter in list(module.named_parameters(recurse=False)):
        if is_experts(module, parameter):
            del module._parameters[name]
            module.add_module(name, quantize_experts(parameter.data))
            routed_one_by_one(module)
    for name, child in list(module.named_children()):
        if isinstance(child, PackedWeight) or kept(prefix + name, child):
            continue
        replacement = quantize_linear(child) if isinstance(child, nn.Linear) else offer(module=child)
        if replacement is not None:
            setattr(module, name, replacement)
        else:
            _replace_modules(child, f"{prefix}{name}.", kept, offer, quantize_linear, quantize_experts)


class Nf4Experts(PackedWeight):
    """``[experts, rows, cols]`` in bitsandbytes' nf4, one quantization (with nested statistics) per
    expert: codes, uint8 absmaxes, their float32 absmaxes and offset; the code tables once."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        import bitsandbytes.functional as bnbf

        super().__init__(weight.shape, dtype)
        states, codes = [], []
        for expert in weight:
            packed, state = bnbf.quantize_4bit(
                expert.to(device), blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4"
            )
            codes.append(packed.reshape(-1))
            states.append(state)
        self.register_buffer("codes", torch.stack(codes))
        self.register_buffer("absmax", torch.stack([state.absmax for state in states]))
        self.register_buffer("nested_absmax", torch.stack([state.state2.absmax for state in states]))
        self.register_buffer(
            "offset", torch.stack([torch.as_tensor(state.offset).reshape(()) for state in states])
        )
        self.register_buffer("quant_map", states[0].code)
        self.register_buffer("nested_quant_map", states[0].state2.code)

    def expert(self, index: int) -> torch.Tensor:
        import bitsandbytes.functional as bnbf

        nested = bnbf.QuantState(
            absmax=self.nested_absmax[index],
            code=self.nested_quant_map,
            blocksize=NF4_NESTED_BLOCK,
            dtype=torch.float32,
        )
        state = bnbf.QuantState(
            absmax=self.absmax[index],
            shape=self.shape[1:],
            code=self.quant_map,
            blocksize=NF4_BLOCK,
            quant_type="nf4",
            dtype=self.dtype,
            offset=self.offset[index],
            state2=nested,
        )
        return bnbf.dequantize_4bit(self.codes[index].reshape(-1, 1), state)


class Int8Experts(PackedWeight):
    """``[experts, rows, cols]`` as int8 codes with a float32 absmax per row: ``W = codes * absmax / 127``."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(weight.shape, dtype)
        weight = weight.to(device=device, dtype=torch.float32)
        absmax = weight.abs().amax(dim=-1).clamp(min=1e-12)
        self.register_buffer("codes", torch.round(weight * (127 / absmax[..., None])).to(torch.int8))
        self.register_buffer("absmax", absmax)

    def expert(self, index: int) -> torch.Tensor:
        scale = (self.absmax[index] / 127)[:, None]
        return (self.codes[index].to(torch.float32) * scale).to(self.dtype)


def _linear_quantizer(quant_type: QuantType, compute_dtype: torch.dtype) -> Callable[[nn.Linear], nn.Module]:
    try:
        import bitsandbytes as bnb
    except ImportError as error:
        raise ImportError(
            f"quant_type {quant_type.value!r} needs bitsandbytes: pip install 'petals-core[quantization]'"
        ) from error

    def quantize_linear(linear: nn.Linear) -> nn.Module:
        weight = linear.weight.data
        with torch.device("meta"):  # skip allocating a random initial weight
            if quant_type is QuantType.INT8:
                layer = bnb.nn.Linear8bitLt(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    has_fp16_weights=False,
                    threshold=6.0,
                )
            else:
                layer = bnb.nn.Linear4bit(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    compute_dtype=compute_dtype,
                    compress_statistics=True,
                    quant_type="nf4",
                )
        if quant_type is QuantType.INT8:
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            layer.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=True
            )
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        return layer

    return quantize_linear
