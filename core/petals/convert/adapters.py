"""LoRA adapters preloaded onto a served block and chosen per request.

Adapters come from a local directory or a Hugging Face repo (``adapter_config.json`` +
``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes them). Only safetensors are
read: an adapter shipping only ``adapter_model.bin`` is refused, never unpickled. Each adapter's
tensors for this block are injected with peft under the adapter's name; ``using_adapter`` makes
one active for the duration of a request, and outside it the block computes the base model.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from safetensors.torch import load_file
from torch import nn
from transformers import PretrainedConfig

from petals.checkpoint import Checkpoint

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_WEIGHTS = "adapter_model.bin"


class AdapterError(ValueError):
    """An adapter cannot be loaded or is not loaded."""


def load_adapters(
    block: nn.Module,
    block_index: int,
    adapters: Mapping[str, str | os.PathLike],
    config: PretrainedConfig,
    **hub_kwargs,
) -> nn.Module:
    """Inject every LoRA adapter ``{name: directory or repo id}`` into ``block`` (block ``block_index``).

    Works on plain and on bitsandbytes-quantized blocks. ``hub_kwargs`` (``cache_dir``,
    ``revision``, ``token``) go to the hub download. All adapters stay inactive until
    ``using_adapter`` selects one.
    """
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    _mark_quantized_linears(block)
    loaded = dict(getattr(block, "petals_adapters", {}))
    for name, source in adapters.items():
        config_path, weights_path = adapter_files(name, source, **hub_kwargs)
        lora_config = LoraConfig.from_pretrained(config_path.parent)
        if lora_config.peft_type != "LORA":
            raise AdapterError(
                f"adapter {name!r} is a {lora_config.peft_type} adapter; only LoRA is supported"
            )
        weights = _block_weights(load_file(weights_path), config.block_prefix, block_index)
        if weights:  # an adapter may skip some layers (layers_to_transform): the block then stays base
            with warnings.catch_warnings():  # peft warns that a second adapter joins the first: intended
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                inject_adapter_in_model(lora_config, block, adapter_name=name)
            result = set_peft_model_state_dict(block, weights, adapter_name=name)
            if result.unexpected_keys:
                raise AdapterError(
                    f"adapter {name!r}: tensors not matching block {block_index}: {result.unexpected_keys}"
                )
        loaded[name] = str(source)
    block.petals_adapters = loaded
    block.petals_adapter_lock = getattr(block, "petals_adapter_lock", None) or threading.RLock()
    _activate(block, None)
    return block


def adapter_files(name: str, source: str | os.PathLike, **hub_kwargs) -> tuple[Path, Path]:
    """The local paths of an adapter's config and safetensors weights (downloaded if a hub repo).

    Raises ``AdapterError`` when either is missing, e.g. for an adapter saved only as a pickle.
    """
    files = Checkpoint(str(source), {}, {"cache_dir": None, "revision": None, "token": None} | hub_kwargs)
    config_path, weights_path = files.fetch(ADAPTER_CONFIG), files.fetch(ADAPTER_WEIGHTS)
    if weights_path is None:
        pickled = files.fetch(PICKLE_WEIGHTS) is not None
        raise AdapterError(
            f"adapter {name!r} ({source}) has no {ADAPTER_WEIGHTS}"
            + (
                f", only the pickle file {PICKLE_WEIGHTS}, which petals refuses to unpickle"
                if pickled
                else ""
            )
            + "; re-save it with save_pretrained(safe_serialization=True)"
        )
    if config_path is None:
        raise AdapterError(f"adapter {name!r} ({source}) has no {ADAPTER_CONFIG}")
    return config_path, weights_path


@contextmanager
def using_adapter(block: nn.Module, name: str | None) -> Iterator[nn.Module]:
    """Run ``block`` with adapter ``name`` (None or "": the base model) inside the ``with``.

    Adapter choice is module state, so concurrent requests on one block are serialized here.
    """
    loaded = getattr(block, "petals_adapters", {})
    if name and name not in loaded:
        raise AdapterError(
            f"adapter {name!r} is not loaded on this server; loaded: {', '.join(sorted(loaded)) or 'none'}"
        )
    if not loaded:
        yield block
        return
    with block.petals_adapter_lock:
        _activate(block, name or None)
        try:
            yield block
        finally:
            _activate(block, None)


def _activate(block: nn.Module, name: str | None) -> None:
    from peft.tuners.lora import LoraLayer

    for layer in block.modules():
        if isinstance(layer, LoraLayer):
            active = name is not None and name in layer.lora_A
            layer.enable_adapters(active)
            if active:
                layer.set_adapter(name, inference_mode=True)


def _block_weights(weights: dict, block_prefix: str, block_index: int) -> dict:
    """The tensors of one block, named relative to it (``self_attn.q_proj.lora_A.weight``)."""
    marker = f"{block_prefix}.{block_index}."
    selected = {}
    for key, tensor in weights.items():
        start = key.find(marker)
        if start == 0 or (start > 0 and key[start - 1] == "."):
            selected[key[start + len(marker) :]] = tensor
    return selected


def _mark_quantized_linears(block: nn.Module) -> None:
    """peft picks its bitsandbytes LoRA layers by these flags, which transformers sets on whole models."""
    names = {type(module).__name__ for module in block.modules()}
    block.is_loaded_in_8bit = "Linear8bitLt" in names
    block.is_loaded_in_4bit = "Linear4bit" in names
