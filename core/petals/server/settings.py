"""What a server is told before it starts, with every default written once.

A ``ServerSettings`` is first what was asked (``petals serve`` maps the options it was given onto
it; the rest keep these defaults). Defaults that depend on the machine or the model are left open
here (``None``, ``"auto"``) and described in the field's ``metadata["default"]``;
``petals.server.planning.resolve_settings`` decides them (device, dtype, quantization, limits,
number of blocks, throughput) and returns the settings a ``Server`` runs with.

Imports neither torch nor hivemind: ``petals serve --help`` reads the defaults from here.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from petals.network.p2p import NetworkOptions
    from petals.server.throughput import ThroughputInfo

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
QUANT_TYPE_CHOICES = ("none", "int8", "nf4")
WEIGHTS_CHOICES = ("packed", "dequantized")
THROUGHPUT_CHOICES = ("auto", "eval", "dry_run")


class SettingError(ValueError):
    """A setting that cannot work with this model or machine; ``setting`` names it (as its option)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


# activation bytes that backward requests may keep, together, between their forward and backward passes;
# blocks past this are recomputed during the backward pass instead (Petals recomputes every block)
BACKWARD_GRAPH_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelLimits:
    """Defaults of the per-block limits, chosen by ``planning.default_limits`` from the model."""

    attn_cache_tokens: int
    max_batch_size: int
    inference_max_length: int


# Petals' defaults: with grouped-query (or multi-query) attention a cached token takes a fraction of
# the bytes, so such models get 4x the tokens for about the same memory
GROUPED_KV_LIMITS = ModelLimits(attn_cache_tokens=16384, max_batch_size=8192, inference_max_length=8192)
FULL_KV_LIMITS = ModelLimits(attn_cache_tokens=4096, max_batch_size=2048, inference_max_length=2048)


def _decided(how: str) -> Any:
    """A field left ``None`` here, whose default ``how`` describes (most are decided by ``resolve_settings``)."""
    return field(default=None, metadata={"default": how})


def _by_model(name: str) -> Any:
    return _decided(
        f"{getattr(GROUPED_KV_LIMITS, name)} for models with grouped-query attention, "
        f"else {getattr(FULL_KV_LIMITS, name)}"
    )


@dataclass(frozen=True)
class ServerSettings:
    """Everything a server is told before it starts (see ``petals serve --help``).

    After ``resolve_settings``: ``dtype`` is a ``torch.dtype``, ``device`` and the
    ``tensor_parallel_devices`` are ``torch.device``, ``throughput`` is a ``ThroughputInfo`` and
    no ``None`` is left among the fields decided by a rule.
    """

    model: str
    network: NetworkOptions
    num_blocks: int | None = _decided("as many as fit in memory")
    block_indices: range | None = None
    dht_prefix: str | None = _decided("derived from the model name by its family's rule")
    token: str | bool | None = None
    revision: str | None = None
    cache_dir: Path | None = _decided(
        "Hugging Face's cache for weights, $PETALS_CACHE or ~/.cache/petals for throughput measurements"
    )
    max_disk_space: int | None = None  # bytes the hub cache may use (petals.disk_cache)
    skip_reachability_check: bool = False
    dtype: torch.dtype | str = field(
        default="auto",
        metadata={"default": "auto: the checkpoint's dtype; a float32 one in bfloat16 on GPUs"},
    )
    device: torch.device | str | None = _decided(
        "the first --tensor_parallel_devices, else cuda if available, else cpu"
    )
    quant_type: str | None = _decided("nf4 on GPUs, none on CPU or with --tensor_parallel_devices")
    # a quantized checkpoint's weights: kept in their stored bytes, or dequantized at load (faster, more memory)
    weights: str = field(
        default="packed",
        metadata={"default": "packed (dequantized where --quant_type or --tensor_parallel_devices needs it)"},
    )
    tensor_parallel_devices: tuple[torch.device | str, ...] = ()
    adapters: tuple[str, ...] = ()  # each a local directory or a repo id, also the name clients ask for
    throughput: ThroughputInfo | float | str = "auto"  # a number, or one of THROUGHPUT_CHOICES
    max_batch_size: int | None = _by_model("max_batch_size")
    inference_max_length: int | None = _by_model("inference_max_length")
    attn_cache_tokens: int | None = _by_model("attn_cache_tokens")
    request_timeout: float = 3 * 60
    session_timeout: float = 30 * 60
    step_timeout: float = 5 * 60
    update_period: float = 60
    expiration: float | None = _decided("max(2 × update_period, 3)")
    placement: str = "ours"  # the placement policy: ours or petals22 (petals.policies)
    balance_quality: float = 0.75
    mean_balance_check_period: float = 60
    stats_period: float = 60
    # seconds a decode step may wait for other sessions' steps expected by then (0: never waits)
    merge_window: float = 0.0
    # torch threads for small steps (up to 64 tokens); larger ones use all
    decode_threads: int | None = _decided(
        "one or all, whichever the server measures to finish its steps sooner"
    )
    backward_graph_budget: int = field(default=BACKWARD_GRAPH_BYTES, metadata={"default": "1GiB"})
    public_name: str | None = None

    def load_config(self):
        """The distributed config of ``model`` (its family's plugin), with ``dht_prefix`` applied."""
        from petals.auto import AutoDistributedConfig

        return AutoDistributedConfig.from_pretrained(
            self.model,
            dht_prefix=self.dht_prefix,
            cache_dir=self.cache_dir,
            token=self.token,
            revision=self.revision,
        )


SETTING_NAMES = frozenset(setting.name for setting in fields(ServerSettings))


def describe_default(name: str) -> str | None:
    """The default of setting ``name`` as ``--help`` shows it: the value, or the rule that decides it."""
    setting = next(setting for setting in fields(ServerSettings) if setting.name == name)
    if "default" in setting.metadata:
        return setting.metadata["default"]
    if setting.default is MISSING or setting.default in (None, False, ()):
        return None
    return f"{setting.default:g}" if isinstance(setting.default, float | int) else str(setting.default)
