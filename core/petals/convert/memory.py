"""How much memory a served block's weights take: measured on a converted block, or estimated from its config.

How many blocks fit on a device is decided by ``petals.server.planning.plan_num_blocks``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from petals.formats import StoredWeights


def block_weight_bytes(block: nn.Module) -> int:
    """Bytes of a block's weights as held: every tensor of its state dict, quantization state included.

    bitsandbytes layers put their scales (``SCB``, nf4 ``absmax``/``quant_map``, nested statistics)
    into the state dict, and packed weights their stored parts, so quantized blocks are measured with
    their overhead. Tensors shared between names are counted once; non-persistent buffers (e.g. rotary
    frequencies) are not weights.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in block.state_dict(keep_vars=True).values():
        if not torch.is_tensor(tensor):
            continue
        key = (
            (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if tensor.numel()
            else (id(tensor), 0)
        )
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total


def is_router(module: nn.Module) -> bool:
    """An MoE router (transformers' ``*Router`` classes): small, and kept exact, as transformers keeps
    several families' in float32. Some are ``nn.Linear`` subclasses whose forward also routes (Llama 4's,
    PhiMoE's), which a quantized linear put in their place would not do."""
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


def estimate_block_weight_bytes(
    config: PretrainedConfig,
    dtype: torch.dtype,
    quant_type: str = "none",
    block_index: int = 0,
    stored: StoredWeights | None = None,
) -> int:
    """What ``block_weight_bytes`` will report for block ``block_index`` of ``config`` after conversion,
    without building it (blocks differ by index: DeepSeek V3's first is dense, 0.58B parameters, its
    others 11.5B with their experts).

    Weight matrices (``weight_matrices``) take what ``quant_type`` makes of them, else what their
    checkpoint's format (``stored``, served packed) stores them in, else ``dtype``; other tensors take
    ``dtype`` (float32 where transformers keeps them so). Built on the meta device: allocates nothing.
    """
    from petals.block import make_block
    from petals.convert.quantization import nbytes
    from petals.loading import kept_in_float32

    with torch.device("meta"):
        block = make_block(config, block_index)
    matrices = {name: is_experts for name, _, is_experts in weight_matrices(block)}
    kept = kept_in_float32(type(block), dtype)
    prefix = f"{config.block_prefix}.{block_index}."
    total = 0
    for name, tensor in block.state_dict().items():
        if name in matrices and quant_type != "none":
            total += nbytes(quant_type, tensor.shape)
            continue
        packed = (
            stored.matrix_nbytes(prefix + name, tensor.shape, matrices[name])
            if name in matrices and stored
            else None
        )
        if packed is not None:
            total += packed
        elif tensor.is_floating_point():
            total += tensor.numel() * (4 if kept and kept.search(name) else dtype.itemsize)
        else:
            total += tensor.numel() * tensor.element_size()
    return total
