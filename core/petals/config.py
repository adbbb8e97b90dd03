"""Config mixins: what a Distributed*Config adds to a Hugging Face config.

A family's config is ``class DistributedXConfig(DistributedConfigMixin, XConfig)``: the HF config
of its model type plus the client, prompt-tuning and LM-head settings below (class-level defaults
that ``from_pretrained(..., key=value)`` overrides), the server-side class attributes
``block_class``, ``attn_class`` and ``block_prefix``, and a ``from_pretrained`` that derives
``dht_prefix`` through the plugins when none is given.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from petals.constants import UID_DELIMITER


class ClientConfig:
    """How a client reaches the swarm (defaults as in Petals 2.2)."""

    initial_peers: Sequence[str] = ()  # multiaddrs of bootstrap peers
    dht_prefix: str | None = None  # DHT key prefix; derived from the model name when None
    daemon_startup_timeout: float = 60
    show_route: str | bool = "inference"
    routing: str = "ours"  # inference routing policy: ours or petals22 (petals.policies.routing)
    allowed_servers: Sequence[str] | None = None
    blocked_servers: Sequence[str] | None = None
    use_server_to_server: bool = True
    connect_timeout: float = 5
    request_timeout: float = 180
    min_step_timeout: float = 5  # an inference step waits at least this long, at most request_timeout
    update_period: float = 60
    max_retries: int | None = (
        int(os.environ["PETALS_MAX_RETRIES"]) if "PETALS_MAX_RETRIES" in os.environ else None
    )
    min_backoff: float = 1
    max_backoff: float = 60
    ban_timeout: float = 15
    active_adapter: str | None = None
    max_pinged: int = 3  # accepted as in Petals; every candidate server is pinged (routing.update)
    ping_timeout: float = 2
    verify: float = 0.0  # the fraction of inference steps recomputed on a second server (``verification``)
    # the client's own libp2p peer (hivemind P2P.create); tests and one-machine swarms listen on
    # 127.0.0.1 only with NAT port mapping, AutoNAT and relays off
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    nat_port_map: bool = True
    auto_nat: bool = True
    use_relay: bool = True
    # a private swarm (petals.membership): the authority's public key, this client's certificate and
    # the identity file it was issued for
    swarm_authority: str | None = None
    membership: str | None = None
    identity_path: str | None = None


class PTuneConfig:
    """Prompt tuning: ``tuning_mode`` None, "ptune" or "deep_ptune" with ``pre_seq_len`` prompts."""

    pre_seq_len: int = 0
    tuning_mode: str | None = None


class LMHeadConfig:
    """The local LM head: computed in vocabulary chunks on CPU so big vocabularies fit in memory."""

    use_chunked_forward: str | bool = "auto"
    chunked_forward_step: int = 16384


class LazyClass:
    """A class attribute naming a class by ``"module:QualName"``, imported on first access.

    Keeps ``import petals_<family>`` cheap: the torch modeling code loads only when a block is built.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def __get__(self, instance: object, owner: type) -> type:
        module_name, _, qualname = self.path.partition(":")
        value: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            value = getattr(value, part)
        return value


class DistributedConfigMixin(ClientConfig, PTuneConfig, LMHeadConfig):
    """Mixed in front of a Hugging Face config class by every family plugin."""

    block_class: ClassVar[type | LazyClass]  # the server-side block (one decoder layer)
    # where transformers builds layers of several classes (attention layers and linear layers, say), the
    # block for the layers of each ``layer_types`` value; a type not named here gets ``block_class``
    block_classes: ClassVar[Mapping[str, type]] = {}
    # the family's attention module (HF class): core's default cache_spec reads its key/value widths
    attn_class: ClassVar[type | LazyClass | None] = None
    block_prefix: ClassVar[str]  # state-dict prefix (and module path) of the layer list, e.g. "model.layers"
    block_output_is_tuple: ClassVar[bool] = False  # HF layer returns (hidden, ...) rather than hidden
    default_pad_token_id: ClassVar[int | None] = None  # set pad_token_id to this when the checkpoint has none

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        kv_heads = getattr(self, "num_key_value_heads", None) or self.num_attention_heads
        return self.num_attention_heads // kv_heads

    def adjust_client_model(self, model: Any) -> None:
        """Change the client's model after core built it (nothing by default).

        The client's transformers model is built from a copy of this config with no layers, then its
        layer list runs every block remotely. A family whose model derives something from its layer
        count while it is built (an index at which layers change behaviour, say) corrects it here.
        """

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any):
        from petals.formats.gguf import gguf_config_dict, gguf_file

        gguf = gguf_file(model_name_or_path)
        if gguf is not None:  # the file's metadata is its config, as transformers reads it (once a process)
            overrides = {key: value for key, value in kwargs.items() if key not in _HUB_KWARGS}
            config = cls.from_dict(gguf_config_dict(gguf), **overrides)
            model_name_or_path = gguf
        else:
            config = super().from_pretrained(model_name_or_path, *args, **kwargs)
        if getattr(config, "pad_token_id", None) is None and cls.default_pad_token_id is not None:
            config.pad_token_id = cls.default_pad_token_id
        if config.dht_prefix is None:
            from petals.plugins import get_plugin_manager

            config.dht_prefix = (
                get_plugin_manager()
                .family_hooks(config)
                .dht_prefix(model_id=model_id(model_name_or_path), config=config)
            )
        validate_dht_prefix(config.dht_prefix)
        return config

    @classmethod
    def get_config_dict(
        cls, model_name_or_path: str | os.PathLike, **kwargs: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """transformers' reading of ``config.json``, except that a multimodal wrapper of this config's
        model type gives the text model's config (``petals.wrappers.text_config_dict``)."""
        from petals.wrappers import text_config_dict

        config_dict, kwargs = super().get_config_dict(model_name_or_path, **kwargs)
        return text_config_dict(config_dict, cls.model_type) or config_dict, kwargs


_HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "proxies", "subfolder")


def model_id(model_name_or_path: str | os.PathLike) -> str:
    """A repo id as given, or a local directory's or file's name (what prefix rules are applied to)."""
    path = Path(model_name_or_path)
    if path.is_dir() or path.is_file():
        return path.resolve().name
    return str(model_name_or_path)


def validate_dht_prefix(prefix: str | None) -> str:
    if not prefix or UID_DELIMITER in prefix or " " in prefix:
        raise ValueError(
            f"invalid dht_prefix {prefix!r}: it must be non-empty and contain neither '{UID_DELIMITER}' nor spaces"
        )
    return prefix
