"""How long a client takes to read its local weights (embeddings, final norm, LM head) from a GGUF file.

The client (``AutoDistributedModelForCausalLM.from_pretrained``) reads the tensors outside the blocks
dense, through ``GGUFCheckpoint.read``: torch dequantization (``petals.formats.gguf_quants``). The
reference is the same tensors read as petals read them before, through gguf's numpy dequantizer, the
architecture's processor and a copy. Both start from the file already opened; opening it (gguf's
reader parsing the metadata, a 262k-token vocabulary for Gemma 3, and transformers' config from it)
is timed apart, once, since the client pays it whichever dequantizer reads the weights. Best of
``--repeats`` runs each, taking turns.

    python benchmarks/gguf_client_load.py [gemma3|smollm2 ...] [--repeats N] [--cache_dir DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def client_keys(path) -> list[str]:
    """The tensors a client reads: every one outside the transformer blocks."""
    from petals.auto import AutoDistributedConfig
    from petals.loading import open_checkpoint

    prefix = AutoDistributedConfig.from_pretrained(path).block_prefix + "."
    return [key for key in open_checkpoint(path).weight_map if not key.startswith(prefix)]


def numpy_reference(checkpoint, keys: list[str]) -> dict[str, torch.Tensor]:
    """The client's tensors as petals read them with gguf's numpy dequantizer."""
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from petals.formats.gguf import reader

    processor = TENSOR_PROCESSORS.get(checkpoint.architecture, TensorProcessor)(config=checkpoint.config_dict)
    to_hf = {name: hf_name for hf_name, name in checkpoint.weight_map.items()}
    by_name = {tensor.name: tensor for tensor in reader(checkpoint.path).tensors}
    tensors = {}
    for key in keys:
        stored = by_name[checkpoint.weight_map[key]]
        values = dequantize(np.asarray(stored.data), stored.tensor_type)
        result = processor.process(
            weights=values, name=stored.name, tensor_key_mapping=to_hf, parsed_parameters={}
        )
        tensors[key] = torch.from_numpy(np.array(result.weights))
    return tensors


def measure(path, repeats: int) -> dict[str, float]:
    from petals.loading import open_checkpoint

    started = time.perf_counter()
    checkpoint = open_checkpoint(path)
    keys = client_keys(path)
    opened = time.perf_counter() - started
    seconds: dict[str, list[float]] = {"torch": [], "numpy": []}
    for _ in range(repeats):
        for name, read in (
            ("torch", checkpoint.read),
            ("numpy", lambda keys: numpy_reference(checkpoint, keys)),
        ):
            started = time.perf_counter()
            tensors = read(keys)
            seconds[name].append(time.perf_counter() - started)
            del tensors
    torch_read, numpy_read = checkpoint.read(keys), numpy_reference(checkpoint, keys)
    assert all(torch.equal(torch_read[key], numpy_read[key].reshape(torch_read[key].shape)) for key in keys)
    return {"open": opened, "torch": min(seconds["torch"]), "numpy": min(seconds["numpy"]), "keys": len(keys)}


def main() -> None:
    from petals.demo_model import DEMO_MODELS, demo_packages_missing, prepare_demo_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["gemma3"], choices=sorted(DEMO_MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache_dir", default=None, help="where the demo models are prepared")
    args = parser.parse_args()
    for key in args.models:
        demo = DEMO_MODELS[key]
        if demo_packages_missing(demo):
            print(f"{demo.name}: skipped ({demo_packages_missing(demo)})")
            continue
        path = prepare_demo_model(args.cache_dir, demo) / demo.gguf_file
        result = measure(path, args.repeats)
        print(
            f"{demo.name}: client embeddings+head load: {result['torch']:.2f} s "
            f"(numpy reference: {result['numpy']:.2f} s), {result['keys']} tensors, equal; "
            f"opening the file before (metadata, config, name map): {result['open']:.1f} s"
        )


if __name__ == "__main__":
    main()
