"""Distributed models: a transformers model whose transformer blocks run in the swarm.

No family needs model code here. The transformers class of the checkpoint's model type is built
with no layers (on the meta device, then its buffers computed), then its layer list (the family config's
``block_prefix``) becomes a one-element list holding ``_RemoteLayers``, which runs every block
remotely and returns what an HF layer returns. Embeddings, norms and the LM head run locally with
transformers' own code, loaded from only their tensors in the checkpoint.

Prompt tuning (``tuning_mode`` "ptune" / "deep_ptune", ``pre_seq_len``): trainable prompts are
prepended to the input embeddings at position 0 (a forward hook on the input embeddings), deep
prompts ``[num_blocks, batch, pre_seq_len, hidden]`` travel to the servers, and the prompt
positions are stripped from the blocks' output.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
    GenerationConfig,
    PretrainedConfig,
)

from petals import tracing
from petals.auto import AutoDistributedConfig
from petals.block import LayerListStandIn
from petals.checkpoint import Checkpoint, stored_names
from petals.client.generation import RemoteGenerationMixin
from petals.client.inference_session import InferenceSession
from petals.client.lm_head import ChunkedLMHead
from petals.client.prompts import (
    PromptsFileError,
    PromptsHeader,
    check_header,
    config_sha256,
    read_header,
    read_tensors,
    save_prompts,
)
from petals.client.remote_sequential import RemoteSequential
from petals.client.suspects import Suspect
from petals.config import model_id
from petals.formats import dequantize_tensors, with_companions
from petals.loading import open_checkpoint
from petals.meta_device import NoReferenceOpsOnMeta as _NoReferenceOpsOnMeta
from petals.network.client import LOOPBACK_CLIENT, ClientNetwork

logger = logging.getLogger(__name__)

PTUNE_MODES = ("ptune", "deep_ptune")
_PROMPT_MODULES = ("prompt_embeddings", "intermediate_prompt_embeddings")
_HUB_KWARGS = ("cache_dir", "revision", "token")


class _RemoteLayers(LayerListStandIn):
    """The only entry of the HF layer list: all blocks, remotely."""

    def __init__(self, remote: RemoteSequential, output_is_tuple: bool, owner: DistributedModelMixin) -> None:
        super().__init__()
        self.remote = remote
        self.output_is_tuple = output_is_tuple
        self._owner = weakref.ref(owner)  # not a submodule: the owner contains us

    def layer_list_config(self) -> PretrainedConfig:
        return self._owner().config

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        owner = self._owner()
        prefix, owner.prepended_prompts = owner.prepended_prompts, 0
        deep = owner.deep_prompts(hidden_states.shape[0], hidden_states.dtype) if prefix else None
        output = self.remote(hidden_states, deep)
        if prefix:
            output = output[:, prefix:]
            if self.remote.active_session is not None:
                self.remote.active_session.prompt_length = prefix
        return (output, None) if self.output_is_tuple else output


class DistributedModelMixin:
    """In front of a transformers model class; see the module docstring."""

    def __init__(self, config: PretrainedConfig, *, network: ClientNetwork | None = None) -> None:
        # tensors on the meta device take no memory until the checkpoint fills them; torch.device is a
        # mode of this thread only (accelerate's init_empty_weights swaps nn.Module.register_parameter)
        with _plain_copy_without_layers(config) as plain, torch.device("meta"), _NoReferenceOpsOnMeta():
            super().__init__(plain)
            self._use_chunked_lm_head(config)
        for module in self.modules():
            if vars(module).get("config") is plain:
                module.config = config
        self._compute_buffers()
        parent_name, _, attribute = self._blocks_path.rpartition(".")
        remote = RemoteSequential(config, network=network)
        setattr(
            self.get_submodule(parent_name),
            attribute,
            nn.ModuleList([_RemoteLayers(remote, config.block_output_is_tuple, self)]),
        )
        self._thread_state = threading.local()  # prompts prepended by this thread's current forward
        self._init_prompts(config)
        config.adjust_client_model(self)

    @property
    def prepended_prompts(self) -> int:
        return getattr(self._thread_state, "prepended_prompts", 0)

    @prepended_prompts.setter
    def prepended_prompts(self, count: int) -> None:
        self._thread_state.prepended_prompts = count

    @property
    def remote_blocks(self) -> RemoteSequential:
        return self.get_submodule(self._blocks_path)[0].remote

    @property
    def _blocks_path(self) -> str:
        """The layer list's module path: ``block_prefix`` (the checkpoint's, e.g. "model.layers"), less the
        base model's prefix in a model that is the base model itself (``AutoDistributedModel``)."""
        prefix, base = self.config.block_prefix, f"{self.base_model_prefix}."
        if prefix.startswith(base) and not hasattr(self, self.base_model_prefix):
            return prefix.removeprefix(base)
        return prefix

    def suspects(self) -> list[Suspect]:
        """Servers this client caught returning wrong outputs (``verify``): peer id, blocks, evidence."""
        return self.remote_blocks.manager.suspects.list()

    def close(self) -> None:
        """Leave the swarm: stop this model's p2p daemon and DHT node (its sessions must be closed)."""
        self.remote_blocks.network.close()

    @property
    def prompt_length(self) -> int:
        return self.config.pre_seq_len if self.config.tuning_mode in PTUNE_MODES else 0

    def inference_session(
        self, max_length: int, keep: bool = False
    ) -> contextlib.AbstractContextManager[InferenceSession]:
        """``with model.inference_session(max_length=N) as session:`` — forward and generate continue it.
        With ``keep=True`` its servers keep it afterwards: ``generate(..., session=session)`` continues it."""
        return self.remote_blocks.inference_session(max_length=max_length + self.prompt_length, keep=keep)

    def use_session(self, session: InferenceSession) -> contextlib.AbstractContextManager[InferenceSession]:
        return self.remote_blocks.use_session(session)

    def forward(self, *args: Any, **kwargs: Any):
        # servers attend to every position: only an all-ones mask is meaningful, and dropping it saves work
        if len(args) > 1:
            args = (args[0], None, *args[2:]) if _is_unpadded(args[1]) else _refuse_padding()
        elif kwargs.get("attention_mask") is not None:
            if not _is_unpadded(kwargs["attention_mask"]):
                _refuse_padding()
            kwargs["attention_mask"] = None
        if tracing.client_log is not None and kwargs.get("input_ids") is not None:
            kwargs = self._traced_embeddings(tracing.client_log, kwargs)
        return super().forward(*args, **self._session_positions(args, kwargs))

    def _session_positions(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with the positions of a step inside a session, where none are given: transformers'
        model, which holds no cache here, would number the step's tokens from 0, and a model that adds
        learned position embeddings before its layers would embed them at the wrong positions."""
        session = self.remote_blocks.active_session
        if session is None or not session.position or kwargs.get("position_ids") is not None or len(args) > 2:
            return kwargs
        if not _takes_position_ids(super().forward):
            return kwargs
        inputs = (
            kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        )
        if inputs is None and args:
            inputs = args[0]
        if inputs is None:
            return kwargs
        steps = torch.arange(session.position, session.position + inputs.shape[1], device=inputs.device)
        return {**kwargs, "position_ids": steps.expand(inputs.shape[0], -1)}

    def _traced_embeddings(self, log: tracing.StepLog, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Embed ``input_ids`` here (as the model would) to time it for the step about to be sent."""
        if kwargs.get("inputs_embeds") is not None:
            return kwargs
        started = time.perf_counter()
        embeddings = self.get_input_embeddings()(kwargs["input_ids"])
        log.pending.add("client: embeddings", time.perf_counter() - started)
        return {**kwargs, "input_ids": None, "inputs_embeds": embeddings}

    # ---- prompt tuning -----------------------------------------------------------------------

    def _init_prompts(self, config: PretrainedConfig) -> None:
        if config.tuning_mode is None:
            return
        if config.tuning_mode not in PTUNE_MODES:
            raise ValueError(f"unknown tuning_mode {config.tuning_mode!r}; use one of {PTUNE_MODES} or None")
        if config.pre_seq_len < 1:
            raise ValueError(f"tuning_mode {config.tuning_mode!r} needs pre_seq_len >= 1")
        hidden = config.hidden_size
        self.prompt_embeddings = nn.Embedding(config.pre_seq_len, hidden, dtype=torch.float32)
        if config.tuning_mode == "deep_ptune":
            self.intermediate_prompt_embeddings = nn.Embedding(
                config.pre_seq_len, config.num_hidden_layers * hidden, dtype=torch.float32
            )
            nn.init.zeros_(self.intermediate_prompt_embeddings.weight)
        self._prompt_hook = self.get_input_embeddings().register_forward_hook(_prepend_prompts(self))

    def deep_prompts(self, batch_size: int, dtype: torch.dtype) -> torch.Tensor | None:
        if self.config.tuning_mode != "deep_ptune":
            return None
        weight = self.intermediate_prompt_embeddings.weight
        prompts = weight.view(self.config.pre_seq_len, self.config.num_hidden_layers, -1).permute(1, 0, 2)
        return prompts.unsqueeze(1).expand(-1, batch_size, -1, -1).to(dtype)

    def save_prompts(self, path: str | os.PathLike) -> None:
        """Write the trained prompts, with what they were trained for, to a safetensors file."""
        if self.config.tuning_mode not in PTUNE_MODES:
            raise ValueError("this model has no trainable prompts (load it with tuning_mode and pre_seq_len)")
        source, hub_kwargs = self._source
        header = PromptsHeader(
            model_id(source),
            self.config.tuning_mode,
            self.config.pre_seq_len,
            config_sha256(source, **hub_kwargs),
        )
        tensors = {key: getattr(self, key).weight for key in _PROMPT_MODULES if hasattr(self, key)}
        save_prompts(path, header, tensors)

    def with_prompts(self, path: str | os.PathLike) -> DistributedModelMixin:
        """A second model that puts the prompts in ``path`` (``save_prompts``) before every input, sharing
        this one's connection to the swarm and its local weights (embeddings, norms, head), not copies:
        a base model and tuned variants of it cost one load. Closing either closes the connection."""
        header = read_header(path)
        config = copy.deepcopy(self.config)
        config.tuning_mode, config.pre_seq_len = header.tuning_mode, header.pre_seq_len
        tuned = type(self)(config, network=self.remote_blocks.network)
        tuned._source = self._source
        shared = {
            name: tensor for name, tensor in self.state_dict().items() if "prompt_embeddings" not in name
        }
        tuned._assign_local_tensors(shared, dtype=None)
        tuned.generation_config = copy.deepcopy(self.generation_config)
        tuned.load_prompts(path)
        return tuned.eval()

    @torch.no_grad()
    def load_prompts(self, path: str | os.PathLike) -> None:
        """Use the prompts of a file saved by ``save_prompts`` (for this base model, mode and length)."""
        header = read_header(path)
        source, hub_kwargs = self._source
        check_header(path, header, model_id(source), config_sha256(source, **hub_kwargs))
        mine = (self.config.tuning_mode, self.config.pre_seq_len)
        if (header.tuning_mode, header.pre_seq_len) != mine:
            raise PromptsFileError(
                f"{path} holds {header.tuning_mode} prompts of length {header.pre_seq_len}; this model was "
                f"loaded with tuning_mode={mine[0]!r}, pre_seq_len={mine[1]}"
            )
        tensors = read_tensors(path)
        for module_name in _PROMPT_MODULES:
            if hasattr(self, module_name):
                weight = getattr(self, module_name).weight
                if module_name not in tensors or tensors[module_name].shape != weight.shape:
                    raise PromptsFileError(f"{path}: {module_name} is missing or has the wrong shape")
                weight.copy_(tensors[module_name])

    # ---- loading -----------------------------------------------------------------------------

    @torch.no_grad()
    def _compute_buffers(self) -> None:
        """Compute the buffers created on the meta device (rotary frequencies, ...) as transformers'
        own loading does: by ``_init_weights`` of their module, from the config."""
        for module in self.modules():
            names = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
            for name in names:
                meta = getattr(module, name)
                setattr(module, name, torch.full(meta.shape, float("nan")).to(meta.dtype))
            if names:
                self._init_weights(module)
            unset = [name for name in names if getattr(module, name).isnan().any()]  # False for integers
            if unset:
                raise NotImplementedError(
                    f"transformers' {type(self).__name__} does not compute the buffers {unset} of its "
                    f"{type(module).__name__} on its own, so petals cannot build it without its layers"
                )

    def _use_chunked_lm_head(self, config: PretrainedConfig) -> None:
        head = self.get_output_embeddings() if hasattr(self, "get_output_embeddings") else None
        if isinstance(head, nn.Linear):
            self.set_output_embeddings(
                ChunkedLMHead(head.in_features, head.out_features, head.bias is not None, config)
            )

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | os.PathLike,
        *,
        config: PretrainedConfig,
        network: ClientNetwork | None = None,
        dtype: torch.dtype | None = None,
        **hub_kwargs: Any,
    ):
        config.name_or_path = str(model_name_or_path)  # as transformers sets it; ``verify`` reads it
        model = cls(config, network=network)
        model._source = (model_name_or_path, hub_kwargs)
        checkpoint = open_checkpoint(model_name_or_path, **hub_kwargs)
        model._load_local_tensors(checkpoint, dtype)
        with contextlib.suppress(Exception):  # checkpoints without generation_config.json keep the default
            if model.can_generate():
                model.generation_config = GenerationConfig.from_pretrained(model_name_or_path, **hub_kwargs)
        return model.eval()

    def _load_local_tensors(self, checkpoint: Checkpoint, dtype: torch.dtype | None) -> None:
        """Fill embeddings, norms and heads from the checkpoint (never a block's tensors)."""
        wanted = [name for name in self.state_dict(keep_vars=True) if "prompt_embeddings" not in name]
        found = {
            name: _checkpoint_key(name, checkpoint.weight_map, self.base_model_prefix, self.config.model_type)
            for name in wanted
        }
        found = {name: key for name, key in found.items() if key is not None}
        keys = with_companions(self.config, sorted(set(found.values())), checkpoint.weight_map)
        tensors = dequantize_tensors(self.config, checkpoint.read(keys, dtype), dtype)
        self._assign_local_tensors({name: _cast(tensors[key], dtype) for name, key in found.items()}, dtype)

    def _assign_local_tensors(
        self, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None
    ) -> None:
        """Use ``state_dict``'s tensors themselves (no copy) as the local weights, frozen; initialise the rest."""
        self.load_state_dict(state_dict, strict=False, assign=True)
        for parameter in self.parameters():
            parameter.requires_grad_(False)  # local embeddings, norms and head are frozen, as in Petals
        self.tie_weights()
        fresh = [name for name, tensor in self.named_parameters() if tensor.is_meta]
        if fresh:
            logger.warning("Not in the checkpoint, initialised randomly (trainable): %s", ", ".join(fresh))
            self._materialize(fresh, dtype)
        for parameter in self._prompt_parameters():
            parameter.requires_grad_(True)

    def _materialize(self, names: list[str], dtype: torch.dtype | None) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        for name in names:
            module_name, _, attribute = name.rpartition(".")
            module = self.get_submodule(module_name)
            meta = getattr(module, attribute)
            value = torch.zeros(meta.shape, dtype=dtype or torch.float32)
            if attribute != "bias":
                value.normal_(0.0, std)
            setattr(module, attribute, nn.Parameter(value, requires_grad=True))

    def _prompt_parameters(self) -> Iterator[nn.Parameter]:
        for name in _PROMPT_MODULES:
            if hasattr(self, name):
                yield from getattr(self, name).parameters()


def _prepend_prompts(model: DistributedModelMixin):
    owner = weakref.ref(model)

    def hook(module: nn.Module, args: tuple, embeddings: torch.Tensor) -> torch.Tensor:
        model = owner()
        if model is None or model.remote_blocks.position > 0:
            return embeddings
        prompts = model.prompt_embeddings.weight.unsqueeze(0).expand(embeddings.shape[0], -1, -1)
        model.prepended_prompts = prompts.shape[1]
        return torch.cat([prompts.to(embeddings.dtype), embeddings], dim=1)

    return hook


@functools.cache
def _takes_parameter(forward: Any, name: str) -> bool:
    return name in inspect.signature(forward).parameters


def _takes_position_ids(bound_forward: Any) -> bool:
    """Whether the model's forward takes ``position_ids`` (read once per class: steps ask every time)."""
    return _takes_parameter(bound_forward.__func__, "position_ids")


def _checkpoint_key(name: str, weight_map: dict[str, str], base_prefix: str, model_type: str) -> str | None:
    """The checkpoint's name for a model tensor: as is, with the base model prefix, or a suffix of it; else
    a name transformers renames to it on loading (``petals.loading.stored_names``)."""
    parts = name.split(".")
    candidates = [name, f"{base_prefix}.{name}"] + [".".join(parts[start:]) for start in range(1, len(parts))]
    candidates += stored_names(model_type, name)[1:]
    return next((candidate for candidate in candidates if candidate in weight_map), None)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _is_unpadded(mask: torch.Tensor | None) -> bool:
    return mask is None or bool(mask.all())


def _refuse_padding():
    raise ValueError(
        "padded inputs are not supported: remote servers attend to every position, so all sequences of a batch "
        "must have the same length (attention_mask all ones)"
    )


@contextlib.contextmanager
def _plain_copy_without_layers(config: PretrainedConfig) -> Iterator[PretrainedConfig]:
    """A copy of ``config`` as its transformers class and with no layers, for transformers to build the
    local parts from; afterwards ``config`` takes what transformers decided while building (e.g. the
    attention implementation). The caller's config never changes class, nor loses its layers.

    (Heads such as ``*ForSequenceClassification`` build their base model with ``AutoModel.from_config``,
    which knows the transformers config classes only.)
    """
    hf_class = next(klass for klass in type(config).__mro__ if klass.__module__.startswith("transformers."))
    plain = hf_class.from_dict(config.to_dict())
    plain.num_hidden_layers = 0
    given = dict(vars(plain))
    yield plain
    for key, value in vars(plain).items():
        if key != "num_hidden_layers" and (key not in given or given[key] != value):
            setattr(config, key, value)


# ---- AutoDistributed* ---------------------------------------------------------------------------

_CLASSES: dict[tuple[type, ...], type] = {}


def distributed_class(config: PretrainedConfig, auto: type[_AutoDistributed]) -> type:
    """The transformers class for ``config`` in ``auto``'s mapping, with ``auto``'s mixins in front."""
    for config_class in type(config).__mro__:
        try:
            hf_class = auto._mapping[config_class]
            break
        except KeyError:
            continue
    else:
        raise ValueError(f"{auto.__name__} has no model class for model type {config.model_type!r}")
    key = (*auto._mixins, hf_class)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Distributed{hf_class.__name__}", key, {"__module__": __name__})
    return _CLASSES[key]


class _AutoDistributed:
    _mapping: Mapping  # transformers' MODEL_*_MAPPING, what its AutoModel* class looks up
    _mixins: tuple[type, ...]

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | os.PathLike,
        *,
        initial_peers: list[str] | tuple[str, ...] | None = None,
        dht_prefix: str | None = None,
        network: ClientNetwork | None = None,
        dtype: torch.dtype | None = None,
        prompts: str | os.PathLike | None = None,
        loopback: bool = False,
        **config_overrides: Any,
    ):
        """Load the local parts of ``model_name_or_path`` (directory or hub id) and connect to the swarm.

        ``config_overrides`` set any config field: ``ClientConfig`` ones (``request_timeout``,
        ``host_maddrs``, ``nat_port_map``, ...), prompt tuning (``tuning_mode``, ``pre_seq_len``),
        ``num_labels``, ...; ``cache_dir``, ``revision`` and ``token`` reach the hub. ``prompts`` is a
        file written by ``save_prompts`` (``petals tune``): its mode, length and prompts are used.
        ``loopback=True`` keeps the client's peer on 127.0.0.1 with NAT port mapping, AutoNAT and relays
        off, as ``--loopback`` does on the command line (``LOOPBACK_CLIENT``; fields given here win).
        """
        if loopback:
            config_overrides = {**LOOPBACK_CLIENT, **config_overrides}
        if prompts is not None:
            _take_prompt_settings(read_header(prompts), config_overrides)
        hub_kwargs = {key: config_overrides[key] for key in _HUB_KWARGS if key in config_overrides}
        if initial_peers is not None:
            config_overrides["initial_peers"] = tuple(initial_peers)
        config = AutoDistributedConfig.from_pretrained(
            model_name_or_path, dht_prefix=dht_prefix, **config_overrides
        )
        if not config.initial_peers:
            raise ValueError("pass initial_peers=[multiaddr, ...] of the swarm to join")
        model_class = distributed_class(config, cls)
        model = model_class.from_pretrained(
            model_name_or_path, config=config, network=network, dtype=dtype, **hub_kwargs
        )
        if prompts is not None:
            try:
                model.load_prompts(prompts)
            except BaseException:
                model.close()
                raise
        return model


def _take_prompt_settings(header: PromptsHeader, config_overrides: dict[str, Any]) -> None:
    for key, value in (("tuning_mode", header.tuning_mode), ("pre_seq_len", header.pre_seq_len)):
        if config_overrides.setdefault(key, value) != value:
            raise ValueError(f"{key}={config_overrides[key]!r} contradicts the prompts file ({value!r})")


class AutoDistributedModelForCausalLM(_AutoDistributed):
    """The causal LM of any installed family, blocks in the swarm; supports ``generate``."""

    _mapping = MODEL_FOR_CAUSAL_LM_MAPPING
    _mixins = (RemoteGenerationMixin, DistributedModelMixin)


class AutoDistributedModel(_AutoDistributed):
    """The base model (hidden states out) of any installed family, blocks in the swarm."""

    _mapping = MODEL_MAPPING
    _mixins = (DistributedModelMixin,)


class AutoDistributedModelForSequenceClassification(_AutoDistributed):
    """Sequence classification with a local trainable head (``score``), blocks in the swarm."""

    _mapping = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    _mixins = (DistributedModelMixin,)
