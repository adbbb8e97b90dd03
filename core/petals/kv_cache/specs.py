"""What one block caches: a small frozen spec per cache kind, and core's default description of a block.

A spec knows its sizes (bytes per cached token, per sequence) and how many tokens a sequence of
a given length keeps; the engine, the budget and the planner see only those numbers. Each kind is
served by one manager (``petals.kv_cache.MANAGERS``); a kind without a manager is described all the
same, so that a server refuses it in one line instead of computing it wrong.

Core's default (``describe_block``) reads the layer's kind from transformers itself
(``cache_utils.get_layer_types_and_kwargs``: full, sliding, chunked, linear attention, ...) and
its sizes from the config, and where the config does not say, from the family's ``attn_class``
built on the meta device: its key and value projections' widths, or, for a multi-head latent
attention (``latent_widths``: DeepSeek's MLA, as transformers writes it for every family that has
one), the latent and shared rope key it hands its cache instead of per-head keys and values. A layer
that keeps a fixed-size state (transformers' ``linear_attention``, ``conv`` and ``hybrid`` layers:
Mamba-2 mixers, short convolutions) is measured (``measured_state``): its block, built on the meta
device, steps into transformers' own linear-attention cache layer, and the state is what that layer
allocates; a state core cannot measure, or one a step of several tokens ignores, stays unserved, refused
in one line. A family whose cache differs from what transformers' layers cache returns its own spec
from the ``cache_spec`` hook.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PretrainedConfig

# a sliding-window cache keeps this many tokens beyond its window, so that a client can roll back
# (speculative decoding) that far; a larger rewind is refused with a one-line error
REWIND_MARGIN = 64
# a linear-attention state keeps a snapshot of itself before each of its last this many steps, so that a
# client can roll back that many steps (not REWIND_MARGIN's worth: each snapshot is a whole state, as
# large as hundreds of tokens of keys and values; see ``petals.kv_cache.states``)
REWIND_STEPS = 4
# a block of fixed-size states holds one sequence per this many tokens of the server's per-block budget:
# a state of Qwen3-Next-80B (2.1 MiB, snapshots aside) is worth 1000 of its tokens of keys and values
TOKENS_PER_SEQUENCE = 256


@dataclass(frozen=True)
class CacheSpec:
    """One block's cache: a kind and its sizes."""

    kind: ClassVar[str]

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one cached token of one sequence takes (0 for a fixed-size state)."""
        return 0

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        """Bytes one sequence takes whatever its length (0 for attention, whose cost is per token)."""
        return 0

    def budget_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """Bytes a block of this kind keeps for a budget of ``tokens`` tokens (what a server plans for)."""
        return tokens * self.bytes_per_token(dtype)

    def tokens_held(self, length: int) -> int:
        """The most tokens a sequence of ``length`` tokens ever holds in this cache."""
        return length

    @property
    def rewind_steps(self) -> int | None:
        """None: a session rewinds to any position it has cached; else it rewinds only to 0 and to the
        starts of its last ``rewind_steps`` steps (a fixed-size state keeps a copy before each)."""
        return None

    @property
    def reads_from(self) -> int | None:
        """The earlier layer whose keys and values, computed in the same forward, this layer attends with
        (None: its own). Blocks between the two never go to separate servers."""
        return None

    def describe(self) -> str:
        return self.kind.replace("_", " ")


@dataclass(frozen=True)
class FullAttentionSpec(CacheSpec):
    """Keys and values of every token: ``num_kv_heads`` heads of ``key_dim`` and ``value_dim`` values.

    ``num_query_heads`` is how many heads the attention computes; when a layer hands the cache keys
    broadcast to all query heads (as some grouped-query layers do), the cache keeps one head per
    group and expands them again on read.
    """

    num_kv_heads: int
    key_dim: int
    value_dim: int
    num_query_heads: int
    kind: ClassVar[str] = "full_attention"

    def __post_init__(self) -> None:
        if min(self.num_kv_heads, self.key_dim, self.value_dim, self.num_query_heads) <= 0:
            raise ValueError(f"invalid cache spec {self}")
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_query_heads} query heads do not split into {self.num_kv_heads} groups"
            )

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_kv_heads * (self.key_dim + self.value_dim) * dtype.itemsize

    def sharded(self, world_size: int) -> FullAttentionSpec:
        """What one of ``world_size`` tensor-parallel shards caches: its share of key/value groups.

        A single shared key/value head (multi-query attention) cannot be split: every shard keeps a
        copy, so the shards' caches then total ``world_size`` times the unsharded cache.
        """
        if self.num_query_heads % world_size:
            raise ValueError(f"{self.num_query_heads} attention heads do not split over {world_size} devices")
        if self.num_kv_heads != 1 and self.num_kv_heads % world_size:
            raise ValueError(f"{self.num_kv_heads} key/value heads do not split over {world_size} devices")
        num_kv_heads = 1 if self.num_kv_heads == 1 else self.num_kv_heads // world_size
        return dataclasses.replace(
            self, num_kv_heads=num_kv_heads, num_query_heads=self.num_query_heads // world_size
        )


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Keys and values of the last ``window - 1`` tokens (plus a rewind margin): older ones are freed."""

    window: int = 0
    rewind_margin: int = REWIND_MARGIN
    kind: ClassVar[str] = "sliding_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"a sliding window needs a positive size, got {self.window}")

    @property
    def tokens_kept(self) -> int:
        """Tokens a sequence keeps after each step: what its next queries can attend, and the margin."""
        return self.window - 1 + self.rewind_margin

    def tokens_held(self, length: int) -> int:
        return min(length, self.tokens_kept)

    def describe(self) -> str:
        return f"{super().describe()} ({self.window})"


@dataclass(frozen=True)
class ChunkedAttentionSpec(SlidingWindowSpec):
    """Attention within fixed chunks of ``window`` tokens: at most the last chunk is needed."""

    kind: ClassVar[str] = "chunked_attention"


@dataclass(frozen=True)
class IndexedAttentionSpec(FullAttentionSpec):
    """Full attention beside a sparse-attention indexer (transformers' ``indexed_attention`` layers): the
    keys and values of every token, and one indexer key of ``index_dim`` values per token, which the
    layer's indexer scores to pick the tokens each query attends (``cache.update_indexer``). Both are
    kept in the same pages, so they grow, rewind and reorder together."""

    index_dim: int
    kind: ClassVar[str] = "indexed_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.index_dim <= 0:
            raise ValueError(f"invalid cache spec {self}: the indexer keys need a width")

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return super().bytes_per_token(dtype) + self.index_dim * dtype.itemsize


@dataclass(frozen=True)
class LinearAttentionSpec(CacheSpec):
    """A fixed-size state per sequence, whatever its length (gated delta net, Mamba-like layers, short
    convolutions): the last ``conv_kernel`` inputs of a ``conv_dim``-channel causal convolution, kept in
    the server's dtype, and a recurrent state of ``recurrent_shape``, kept in ``recurrent_dtype`` (the
    layers compute it in float32; None: the server's dtype), or no recurrent state at all
    (``recurrent_shape=None``: a layer that caches its convolution's inputs only); plus ``snapshots``
    copies of both, taken before each of the last steps, for rollback."""

    conv_dim: int
    conv_kernel: int
    recurrent_shape: tuple[int, ...] | None
    recurrent_dtype: torch.dtype | None = torch.float32
    snapshots: int = REWIND_STEPS
    kind: ClassVar[str] = "linear_attention"

    def __post_init__(self) -> None:
        if min(self.conv_dim, self.conv_kernel, *(self.recurrent_shape or ())) <= 0 or self.snapshots < 0:
            raise ValueError(f"invalid cache spec {self}")
        if self.recurrent_shape is not None and not self.recurrent_shape:
            raise ValueError(
                f"invalid cache spec {self}: a recurrent state needs a shape (None: no such state)"
            )

    def state_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The recurrent state's dtype on a server computing in ``dtype``."""
        return self.recurrent_dtype or dtype

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one state (conv and recurrent) of one sequence."""
        recurrent = 0
        if self.recurrent_shape is not None:
            recurrent = self.state_dtype(dtype).itemsize
            for size in self.recurrent_shape:
                recurrent *= size
        return self.conv_dim * self.conv_kernel * dtype.itemsize + recurrent

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return (1 + self.snapshots) * self.state_bytes(dtype)

    def sequences(self, tokens: int) -> int:
        """How many sequences a block keeps for a budget of ``tokens`` tokens."""
        return max(1, tokens // TOKENS_PER_SEQUENCE)

    def budget_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        return self.sequences(tokens) * self.bytes_per_sequence(dtype)

    def tokens_held(self, length: int) -> int:
        return 0

    @property
    def rewind_steps(self) -> int:
        return self.snapshots

    def describe(self) -> str:
        return "short convolution" if self.recurrent_shape is None else super().describe()


@dataclass(frozen=True)
class HybridSpec(CacheSpec):
    """A layer that caches both (a state-space mixer beside attention in one layer, as transformers'
    ``hybrid`` layers): keys and values of ``attention`` per token, in pages, and a fixed-size ``state``
    per sequence, in a sequence slot. Each part is sized, held, rewound and budgeted as its own kind."""

    attention: FullAttentionSpec
    state: LinearAttentionSpec
    kind: ClassVar[str] = "hybrid"

    def __post_init__(self) -> None:
        if not isinstance(self.attention, FullAttentionSpec) or not isinstance(
            self.state, LinearAttentionSpec
        ):
            raise ValueError(f"invalid cache spec {self}: an attention spec and a linear-attention state")

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.attention.bytes_per_token(dtype)

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return self.state.bytes_per_sequence(dtype)

    def budget_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        return self.attention.budget_bytes(tokens, dtype) + self.state.budget_bytes(tokens, dtype)

    def tokens_held(self, length: int) -> int:
        return self.attention.tokens_held(length)

    @property
    def rewind_steps(self) -> int:
        return self.state.rewind_steps

    def describe(self) -> str:
        return f"{self.attention.describe()} and {self.state.describe()}"


@dataclass(frozen=True)
class SharedKVSpec(CacheSpec):
    """A layer that caches nothing: it attends with the keys and values layer ``source`` computed in the
    same forward (transformers' ``kv_sharing_modes``: Gemma 4's last layers "reuse" those of the last
    layer of their type that "stores"). ``attention`` is the source's spec: which tokens the keys cover
    (a sliding source's window), hence this layer's mask. A server runs it only in one pass with its
    source: no span of blocks may begin or end between the two (``closed_boundaries``)."""

    source: int
    attention: FullAttentionSpec
    kind: ClassVar[str] = "shared_kv"

    def __post_init__(self) -> None:
        if self.source < 0 or not isinstance(self.attention, FullAttentionSpec):
            raise ValueError(f"invalid cache spec {self}: a source layer and its attention spec")

    def tokens_held(self, length: int) -> int:
        return 0

    @property
    def reads_from(self) -> int:
        return self.source

    def describe(self) -> str:
        return f"shared {self.attention.describe()}"


@dataclass(frozen=True)
class StatelessSpec(CacheSpec):
    """A layer that caches nothing: feed-forward or experts alone, which transformers lists among the
    layer types ("mlp", "moe": its caches hold a placeholder for them, kind "dummy")."""

    kind: ClassVar[str] = "stateless"

    def tokens_held(self, length: int) -> int:
        return 0

    def describe(self) -> str:
        return "no cache (feed-forward only)"


@dataclass(frozen=True)
class UnservedSpec(CacheSpec):
    """A layer kind petals-core describes but has no manager for yet (a server refuses it in one line)."""

    layer_type: str
    # why core does not serve this layer, where it knows more than the kind (compared equal whatever it says)
    reason: str = dataclasses.field(default="", compare=False)
    kind: ClassVar[str] = "unserved"

    def describe(self) -> str:
        return self.layer_type.replace("_", " ")


def describe_block(config: PretrainedConfig, block_index: int) -> CacheSpec:
    """Core's default ``cache_spec``: transformers' kind for this layer, sized from the config."""
    source = kv_source(config, block_index)
    if source is not None:
        return SharedKVSpec(source, describe_block(config, source))
    layer_type, kwargs = layer_kind(config, block_index)
    if layer_type == "dummy":
        return StatelessSpec()
    if layer_type == "linear_attention" and all(hasattr(config, name) for name in _GATED_DELTA_NET):
        return gated_delta_net_spec(config)
    if layer_type in STATE_KINDS:
        return state_spec(config, block_index, layer_type)
    if layer_type not in ("full_attention", "sliding_attention", "chunked_attention"):
        return UnservedSpec(layer_type)
    sizes = attention_sizes(config, block_index)
    if layer_type == "full_attention":
        return FullAttentionSpec(**sizes)
    kind = SlidingWindowSpec if layer_type == "sliding_attention" else ChunkedAttentionSpec
    return kind(**sizes, window=kwargs["sliding_window"])


# the config fields of transformers' gated delta net layers (Qwen3-Next, Qwen3.5, ...); other linear
# layers (Mamba's, short convolutions) name their sizes otherwise: core measures them (``state_spec``)
_GATED_DELTA_NET = (
    "linear_conv_kernel_dim",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_num_value_heads",
    "linear_value_head_dim",
)


def gated_delta_net_spec(config: PretrainedConfig) -> LinearAttentionSpec:
    """The state of a gated delta net layer, as it allocates it: a causal convolution over the queries,
    keys (``num_key_heads x key_head_dim`` each) and values (``num_value_heads x value_head_dim``), and
    a recurrent ``key_head_dim x value_head_dim`` matrix per value head."""
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    values = config.linear_num_value_heads * config.linear_value_head_dim
    return LinearAttentionSpec(
        conv_dim=2 * keys + values,
        conv_kernel=config.linear_conv_kernel_dim,
        recurrent_shape=(
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        ),
    )


# transformers' kinds of layers that keep a fixed-size state (a ``LinearAttentionLayer`` in its caches):
# alone, or beside the keys and values of an attention in the same layer ("hybrid")
STATE_KINDS = ("linear_attention", "conv", "hybrid")
# the dtype a state is measured in: a recurrent state its layer keeps in another one (Mamba-2's, in
# float32) is kept in that one on a server too
_MEASURE_DTYPE = torch.bfloat16


def state_spec(config: PretrainedConfig, block_index: int, layer_type: str) -> CacheSpec:
    """The state of a ``linear_attention``, ``conv`` or ``hybrid`` layer as its block hands it to its cache
    (``measured_state``, of the block the config's ``block_class`` builds), beside the attention's keys
    and values in a hybrid layer. ``UnservedSpec`` where core cannot measure it (a config without a
    block class, a layer of several convolutions, a forward the meta device cannot run): a server then
    refuses the block in one line instead of keeping a state of the wrong shape."""
    state = _cached_state(config, block_index, layer_type)
    if state is None:
        return UnservedSpec(layer_type, _UNMEASURED if getattr(type(config), "block_class", None) else "")
    if layer_type != "hybrid":
        return state
    return HybridSpec(attention=FullAttentionSpec(**attention_sizes(config, block_index)), state=state)


_UNMEASURED = (
    "its state could not be measured from its block, or a step of several tokens ignores the state earlier "
    "steps left (core runs the mixer holding the block's one depthwise convolution on the meta device); a "
    "plugin may return the spec from its cache_spec hook"
)


def measured_state(block: torch.nn.Module, block_index: int, hidden_size: int) -> LinearAttentionSpec | None:
    """What the state-space or convolution mixer of ``block`` (built on the meta device) hands
    transformers' cache, measured on the meta device: a first step of one token into a
    ``LinearAttentionLayer``, then a step of two tokens after it.

    The mixer is the module holding the block's one depthwise ``nn.Conv1d`` (Mamba-2's over its ``x``,
    ``B`` and ``C``; a short convolution's over its input). Transformers' layer keeps the last ``kernel``
    inputs of the channels handed to ``update_conv_state`` and the tensor handed to
    ``update_recurrent_state`` (nothing for a short convolution), in that tensor's dtype. None where the
    block has no such convolution or several, where its forward needs values (the meta device has none),
    where what it hands the cache is not that convolution's input, or where the second step's output
    does not depend on every state the first one left (autograd's graph says, with no values): a layer
    whose steps of several tokens start afresh (transformers' Mamba-1 scan) would be served wrong after
    a session's first step."""
    from transformers.cache_utils import Cache, LinearAttentionLayer

    convolutions = [name for name, module in block.named_modules() if _depthwise(module)]
    if len(convolutions) != 1:
        return None
    conv = block.get_submodule(convolutions[0])
    mixer = block.get_submodule(convolutions[0].rpartition(".")[0]).to("meta", _MEASURE_DTYPE)
    cache = Cache(layers=[LinearAttentionLayer() for _ in range(block_index + 1)])
    layer = cache.layers[block_index]
    try:  # whatever stops a forward, the state is not measured: the block is refused
        _meta_step(mixer, cache, 1, hidden_size)
        conv_state, recurrent = layer.conv_states[0], layer.recurrent_states[0]
        kept = _traced_states(layer)
        output = _meta_step(mixer, cache, 2, hidden_size)
    except Exception:
        return None
    conv_dim, kernel = conv.in_channels, conv.kernel_size[0]
    if conv_state is None or tuple(conv_state.shape[1:]) != (conv_dim, kernel):
        return None
    if not all(_depends_on(output, state) for state in kept):
        return None
    if recurrent is None:
        return LinearAttentionSpec(conv_dim=conv_dim, conv_kernel=kernel, recurrent_shape=None)
    return LinearAttentionSpec(
        conv_dim=conv_dim,
        conv_kernel=kernel,
        recurrent_shape=tuple(recurrent.shape[1:]),
        recurrent_dtype=None if recurrent.dtype == _MEASURE_DTYPE else recurrent.dtype,
    )


def _depthwise(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Conv1d) and module.groups == module.in_channels == module.out_channels


def _meta_step(mixer: torch.nn.Module, cache, tokens: int, hidden_size: int) -> torch.Tensor:
    """The mixer's output for ``tokens`` new tokens on the meta device (with autograd's graph)."""
    with torch.device("meta"), torch.enable_grad():
        output = mixer(torch.zeros(1, tokens, hidden_size, dtype=_MEASURE_DTYPE), cache=cache)
    return output[0] if isinstance(output, tuple) else output


def _traced_states(layer) -> list[torch.Tensor]:
    """Put copies of leaves autograd traces in place of ``layer``'s states (copies: the layer writes its
    next states into them in place); the leaves."""
    leaves = []
    for states in (layer.conv_states, layer.recurrent_states):
        if states[0] is not None:
            leaf = torch.zeros_like(states[0], requires_grad=True)
            states[0] = leaf.clone()
            leaves.append(leaf)
    return leaves


def _depends_on(output: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Whether autograd's graph of ``output`` reaches ``leaf``."""
    seen, nodes = set(), [output.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "variable", None) is leaf:
            return True
        nodes.extend(following for following, _ in node.next_functions)
    return False


# what each block class hands its cache as a state, per (class, config, layer type): a server asks once
# per block, and a planner once per block of every candidate span
_STATES: dict[tuple, LinearAttentionSpec | None] = {}


def _cached_state(config: PretrainedConfig, block_index: int, layer_type: str) -> LinearAttentionSpec | None:
    """``measured_state`` of block ``block_index`` as the config's block class builds it (None for a
    config without one); layers of one type share their state's sizes, so each type is built once."""
    if getattr(type(config), "block_class", None) is None:
        return None
    from petals.block import block_class_of

    block_class = block_class_of(config, block_index)
    key = (block_class, type(config), config.to_json_string(use_diff=False), layer_type)

    def measure() -> LinearAttentionSpec | None:
        with torch.device("meta"):
            block = block_class(config, block_index)
        return measured_state(block, block_index, config.hidden_size)

    return _memoized(_STATES, key, measure)


def _memoized(table: dict, key: tuple, compute: Callable[[], Any]) -> Any:
    """``table[key]``, computed on first use (a table past 256 entries starts again)."""
    if key not in table:
        if len(table) >= 256:
            table.clear()
        table[key] = compute()
    return table[key]


def kv_source(config: PretrainedConfig, block_index: int) -> int | None:
    """The layer whose keys and values layer ``block_index`` reuses, as transformers reads
    ``config.kv_sharing_modes`` (None per layer, or "store" / "reuse"): a "reuse" layer attends with
    those of the last "store" layer of its own type before it. None for a layer with keys of its own.
    ValueError where no such layer exists (every layer reusing)."""
    modes = getattr(config, "kv_sharing_modes", None)
    if not modes or modes[block_index] != "reuse":
        return None
    layer_types = config.layer_types
    for index in range(block_index - 1, -1, -1):
        if modes[index] == "store" and layer_types[index] == layer_types[block_index]:
            return index
    raise ValueError(
        f"layer {block_index} reuses the keys and values of an earlier {layer_types[block_index]} layer, "
        "and no earlier layer of that type stores them (kv_sharing_modes)"
    )


def closed_boundaries(specs: Sequence[CacheSpec]) -> frozenset[int]:
    """Block boundaries where a span of consecutive blocks may neither begin nor end, given each block's
    spec: those after a source layer up to each layer that reuses its keys and values. A span holding a
    reusing layer then holds its source too, and a chain of spans crosses them on one server."""
    closed: set[int] = set()
    for index, spec in enumerate(specs):
        if spec.reads_from is not None:
            closed.update(range(spec.reads_from + 1, index + 1))
    return frozenset(closed)


def check_span(closed: frozenset[int], start: int, end: int) -> None:
    """ValueError, in one line, if blocks ``[start, end)`` begin or end where ``closed_boundaries`` forbids."""
    inside = [edge for edge in (start, end) if edge in closed]
    if not inside:
        return
    low, high = _closed_run(closed, inside[0])
    raise ValueError(
        f"blocks {start}:{end} split blocks {low - 1}:{high + 1}, which share keys and values (later layers "
        f"attend with those of earlier ones, in the same pass): a span may begin or end at {low - 1} or "
        f"{high + 1}, not in between"
    )


def _closed_run(closed: frozenset[int], edge: int) -> tuple[int, int]:
    low = high = edge
    while low - 1 in closed:
        low -= 1
    while high + 1 in closed:
        high += 1
    return low, high


def layer_kind(config: PretrainedConfig, block_index: int) -> tuple[str, dict]:
    """Transformers' cache kind of layer ``block_index`` and its arguments (``sliding_window``, ...), as
    ``cache_utils.get_layer_types_and_kwargs`` says; read directly from the config where it is
    homogeneous (that function walks every layer's config, slowly, for each call)."""
    heterogeneous = config.__dict__.get("_heterogeneity_spec") is not None
    if heterogeneous or getattr(config, "kv_sharing_modes", None) is not None:
        from transformers.cache_utils import get_layer_types_and_kwargs

        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        return layer_types[block_index], layer_kwargs[block_index]
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        layer_type = layer_types[block_index]
    elif getattr(config, "sliding_window", None) is not None:
        layer_type = "sliding_attention"
    elif getattr(config, "attention_chunk_size", None) is not None:
        layer_type = "chunked_attention"
    else:
        layer_type = "full_attention"
    if layer_type in ("moe", "mlp"):
        return "dummy", {}
    if layer_type in ("sliding_attention", "hybrid_sliding"):
        return layer_type, {"sliding_window": config.sliding_window}
    if layer_type == "chunked_attention":
        return layer_type, {"sliding_window": config.attention_chunk_size}
    return layer_type, {}


def attention_sizes(config: PretrainedConfig, block_index: int) -> dict[str, int]:
    """Key/value heads and widths one layer caches per token.

    From the config: ``num_attention_heads``, ``num_key_value_groups`` (query heads per key/value
    head), ``head_dim`` (or ``hidden_size // num_attention_heads``), and, where keys and values
    differ, ``qk_head_dim`` / ``v_head_dim``. Where the config's ``attn_class`` builds key and value
    projections (``k_proj`` / ``v_proj``), their widths win: they are what the layer computes; where it
    is a latent attention (``latent_widths``), one "head" of its latent and rope key does.
    """
    layers = getattr(config, "per_layer_config", None)  # a heterogeneous config's sizes are per layer
    layer = layers[block_index] if layers is not None else config
    num_heads = layer.num_attention_heads
    groups = getattr(config, "num_key_value_groups", None)  # a Distributed*Config's, which families override
    if groups is None:
        groups = num_heads // (getattr(layer, "num_key_value_heads", None) or num_heads)
    num_kv_heads = num_heads // groups
    head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // num_heads
    key_dim = getattr(layer, "qk_head_dim", None) or head_dim
    value_dim = getattr(layer, "v_head_dim", None) or head_dim
    cached = _cached_widths(getattr(type(config), "attn_class", None), config, block_index)
    if cached is not None:
        heads, keys, values = cached
        num_kv_heads = heads or num_kv_heads
        key_dim, value_dim = keys // num_kv_heads, values // num_kv_heads
    return {
        "num_kv_heads": num_kv_heads,
        "key_dim": key_dim,
        "value_dim": value_dim,
        "num_query_heads": num_heads,
    }


def latent_widths(attention: torch.nn.Module) -> tuple[int, int] | None:
    """The widths of the latent and the rope key a multi-head latent attention hands its cache per token,
    or None for another attention module.

    DeepSeek's MLA, as transformers writes it for every family that has one (DeepSeek V2 and V3, Kimi,
    GLM-4.7-Flash, MiniCPM3, Mistral 4, Youtu, LongCat-Flash, ...), projects each token with
    ``kv_a_proj_with_mqa`` into a compressed latent of ``kv_lora_rank`` values and one rope key shared by
    all heads (the rest of that projection), and hands the cache those two as one key/value "head"
    (``cache.update(latent, rope_key)``, each ``[batch, 1, tokens, width]``); it expands them into
    per-head keys and values (``kv_b_proj``) only after reading the cache. A DeepSeek V3 layer so caches
    512 + 64 values per token, where its 128 expanded heads would take 128 x (192 + 128).
    """
    projection = getattr(attention, "kv_a_proj_with_mqa", None)
    rank = getattr(attention, "kv_lora_rank", None)
    if not isinstance(projection, torch.nn.Linear) or not isinstance(rank, int):
        return None
    return rank, projection.out_features - rank


# what ``attn_class`` hands its cache per token, per (class, config, layer type): a server asks once per
# block, and a planner once per block of every candidate span
_WIDTHS: dict[tuple, tuple[int | None, int, int] | None] = {}


def _cached_widths(
    attn_class: type | None, config: PretrainedConfig, block_index: int
) -> tuple[int | None, int, int] | None:
    """``(heads, key width, value width)`` of what ``attn_class``, built on the meta device, hands its cache
    per token (heads None: as many as the config says), or None when it shows neither key and value
    projections nor a latent. Layers of one type share their widths, so each type is built once."""
    if attn_class is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    layer_type = (
        layer_types[block_index] if layer_types is not None and block_index < len(layer_types) else None
    )
    key = (attn_class, type(config), config.to_json_string(use_diff=False), layer_type)
    return _memoized(_WIDTHS, key, lambda: _built_widths(attn_class, config, block_index))


def _built_widths(
    attn_class: type, config: PretrainedConfig, block_index: int
) -> tuple[int | None, int, int] | None:
    attention = _meta_attention(attn_class, config, block_index)
    if attention is None:
        return None
    latent = latent_widths(attention)
    if latent is not None:  # one "head", read by every query head
        return 1, *latent
    k_proj, v_proj = getattr(attention, "k_proj", None), getattr(attention, "v_proj", None)
    if not isinstance(k_proj, torch.nn.Linear) or not isinstance(v_proj, torch.nn.Linear):
        return None
    return None, k_proj.out_features, v_proj.out_features


def _meta_attention(attn_class: type, config: PretrainedConfig, block_index: int) -> torch.nn.Module | None:
    """``attn_class`` built on the meta device from the config (and the layer index, where it takes one);
    None for a class built from other arguments (its layer passes them): the config's sizes count then,
    and the kit checks them against what the layers cache."""
    for arguments in ((config, block_index), (config,)):
        try:
            with torch.device("meta"):
                return attn_class(*arguments)
        except Exception:  # noqa: BLE001 - any failure means: not built from these arguments
            continue
    return None
