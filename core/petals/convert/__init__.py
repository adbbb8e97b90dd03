"""Server-side conversions of a loaded block: quantization, tensor parallelism, LoRA adapters, weight sizes.

A server loads a block on CPU and ``convert_block`` prepares it: ``quantize_block`` (quantizes on
the move to its device), then ``load_adapters``; or ``make_tensor_parallel`` instead for several
devices (combining sharding with quantization or adapters is not supported yet).
"""

from petals.convert.adapters import AdapterError, adapter_files, load_adapters, using_adapter
from petals.convert.block import convert_block
from petals.convert.memory import block_weight_bytes, estimate_block_weight_bytes
from petals.convert.quantization import QuantType, quantize_block
from petals.convert.tensor_parallel import TensorParallelBlock, make_tensor_parallel

__all__ = [
    "AdapterError",
    "QuantType",
    "TensorParallelBlock",
    "adapter_files",
    "block_weight_bytes",
    "convert_block",
    "estimate_block_weight_bytes",
    "load_adapters",
    "make_tensor_parallel",
    "quantize_block",
    "using_adapter",
]
