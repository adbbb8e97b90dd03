"""The conformance kit: does a family plugin compute exactly what transformers computes?

``check_family(tiny_hf_config, workdir)`` builds a tiny random model of the family with
transformers, saves it in the Hugging Face layout and checks, through the public plugin contract
only:

1. registration: the installed plugins map the config's ``model_type`` to a Distributed*Config
   that extends the family's HF config and ``DistributedConfigMixin``;
2. prefix rules: ``AutoDistributedConfig.from_pretrained`` on the saved directory derives a valid
   ``dht_prefix`` from the folder name through the hook, and an explicit ``dht_prefix`` wins;
3. cache sizing: every block's ``cache_spec`` (the hook, or core's default) is a kind the server
   serves, its widths are what the layer really caches (a mismatch fails the first step), and a
   cache holds exactly its spec's bytes per token for the tokens its kind keeps (a sliding window
   ends holding no more than its window and margin, however long the session);
4. exactness (fp32): logits of the full transformers model equal embeddings → blocks loaded one by
   one with ``load_block`` (each its real layer index) → head, without a cache and through a
   prefill, single-token steps and a multi-token step, past every sliding window the config
   declares, with the blocks split over two independent sets of caches as two servers would hold
   them; then a beam reorder (``hypo_ids``), a rewind (``start_from_position``), a kept session
   continued from as far back as every block says it can go (``resumable``), and a failover: the
   session's whole history replayed as one step onto fresh caches, then its next step;
5. batching (fp32): sessions of different lengths and batch sizes, starting at different times, with
   their caches in pages of one shared pool per block, run their steps merged into one forward per
   block, and each session's outputs equal its own solo run (including a reorder and a rewind).

``check_structure(config, workdir)`` runs the checks that need no weights (1 to 3 without the widths a
layer really caches, and every block built on the meta device), so a plugin author can try a real model's
config: it makes no model and no weights, and opens no cache.

Every cache the kit opens is sized in bytes from what its checks run, never in pages of the widest kind:
a standalone cache holds its session's batch and length, and the arena of the batching check gives each
block a stretch of as many pages (of the blocks' shared page bytes) as its sessions' sequences take there.

On a mismatch the message names the attention and experts implementations of the blocks and of the
reference model: a block that computes with another implementation than transformers' full model
(sdpa where the model runs eager, say) differs by more than float rounding.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from petals.auto import AutoDistributedConfig
from petals.block import LayerListStandIn, block_class_of, cache_spec, make_block, shared_kv_kwargs
from petals.config import DistributedConfigMixin, validate_dht_prefix
from petals.kv_cache import (
    PAGE_TOKENS,
    CacheSpec,
    HybridSpec,
    PageArena,
    SlidingWindowSpec,
    furthest_common,
    manager_for,
    open_cache,
)
from petals.kv_cache.arena import page_nbytes_for
from petals.loading import load_block
from petals.plugins import get_plugin_manager


@dataclass(frozen=True)
class StepSchedule:
    """What the exactness check runs: a prefill, single-token steps, then one multi-token step."""

    batch_size: int = 2
    prefill_length: int = 7
    single_steps: int = 8
    chunk_length: int = 3
    atol: float = 1e-5
    seed: int = 0

    @property
    def step_lengths(self) -> list[int]:
        return [self.prefill_length] + [1] * self.single_steps + [self.chunk_length]

    @property
    def max_length(self) -> int:
        return sum(self.step_lengths) + 2  # + the reordered step and its replay

    def past(self, window: int) -> StepSchedule:
        """This schedule with a prefill long enough that its single steps slide past ``window``."""
        return dataclasses.replace(self, prefill_length=max(self.prefill_length, window + PAGE_TOKENS + 2))


# the kit's caches keep one token beyond a sliding window (the server keeps REWIND_MARGIN): pages fall
# out of the window within a few steps, and a one-token rewind is still possible
KIT_REWIND_MARGIN = 1


@dataclass
class ConformanceReport:
    """What was checked and the largest logit differences seen (for the plugin's own logs)."""

    model_type: str
    dht_prefix: str
    cache_specs: list[CacheSpec]
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    merged_sessions_diff: float | None = None  # the largest output difference, merged vs solo sessions


def check_prefix_rules(examples: Mapping[str, str], config: PretrainedConfig) -> None:
    """Check the ``dht_prefix`` hook against ``{model name: expected prefix}`` examples."""
    family = get_plugin_manager().family(config.model_type)
    distributed = family.config_class.from_dict(config.to_dict())
    hook = get_plugin_manager().family_hooks(distributed).dht_prefix
    for model_id, expected in examples.items():
        got = hook(model_id=model_id, config=distributed)
        assert got == expected, f"dht_prefix({model_id!r}) = {got!r}, expected {expected!r}"
        validate_dht_prefix(got)


def check_family(
    config: PretrainedConfig,
    workdir: str | Path,
    *,
    folder_name: str = "Tiny-Model-0.1",
    schedule: StepSchedule = StepSchedule(),
) -> ConformanceReport:
    """Run every conformance check on a tiny config of a family; raise AssertionError on failure."""
    _check_registered(config)
    path = Path(workdir) / folder_name
    reference = _save_random_model(config, path, schedule.seed)
    distributed = _check_dispatch(config, path, folder_name)
    specs = _served_specs(distributed)
    attention = [spec.attention if isinstance(spec, HybridSpec) else spec for spec in specs]
    windows = [spec.window for spec in attention if isinstance(spec, SlidingWindowSpec)]
    if windows:
        schedule = schedule.past(max(windows))

    _check_layer_classes(reference, distributed)
    blocks = [load_block(path, i, torch.float32, config=distributed) for i in range(config.num_hidden_layers)]
    report = ConformanceReport(config.model_type, distributed.dht_prefix, specs)
    _check_exactness(reference, distributed, blocks, specs, report, schedule)
    _check_merged_sessions(distributed, blocks, specs, report, schedule)
    return report


def check_structure(
    config: PretrainedConfig, workdir: str | Path, *, folder_name: str = "Tiny-Model-0.1"
) -> ConformanceReport:
    """The checks that need no weights, on a config of any size (a real model's): registration, prefix
    rules, each block's cache spec a kind the server serves (with the page an arena would give it), and
    each block built on the meta device, as a server builds it before it loads the block's weights.

    Only ``config.json`` is written under ``workdir``: no model, no weights, no cache. Whether the layers
    cache the widths their specs say, exactness and batching need a tiny config's ``check_family``."""
    _check_registered(config)
    path = Path(workdir) / folder_name
    config.save_pretrained(path)
    distributed = _check_dispatch(config, path, folder_name)
    specs = _served_specs(distributed)
    assert _page_nbytes(specs) > 0
    with torch.device("meta"):  # as load_block builds a block: its tensors take no memory
        for index in range(config.num_hidden_layers):
            block = make_block(distributed, index)
            expected = block_class_of(distributed, index)
            assert type(block) is expected, f"block {index}: built {type(block)}, not {expected}"
            built = [name for name, tensor in block.named_parameters() if not tensor.is_meta]
            assert not built, f"block {index} made its parameters {built} outside the meta device"
    return ConformanceReport(config.model_type, distributed.dht_prefix, specs)


def _check_layer_classes(reference: PreTrainedModel, config: PretrainedConfig) -> None:
    """Each block is of the class transformers builds for the layer at its index (a model of several
    decoder-layer classes names each in ``block_classes``)."""
    for index, layer in enumerate(reference.get_submodule(config.block_prefix)):
        block = block_class_of(config, index)
        assert issubclass(block, type(layer)), (
            f"block {index} is a {block.__name__}, but transformers builds layer {index} as a "
            f"{type(layer).__name__}: name its class in the config's block_classes for that layer type"
        )


def _check_registered(config: PretrainedConfig) -> None:
    family = get_plugin_manager().family(config.model_type)
    assert issubclass(family.config_class, DistributedConfigMixin), (
        f"{family.config_class.__name__} must mix in petals.config.DistributedConfigMixin"
    )
    assert issubclass(family.config_class, type(config)), (
        f"{family.config_class.__name__} must extend {type(config).__name__}"
    )


def _check_dispatch(config: PretrainedConfig, path: Path, folder_name: str) -> PretrainedConfig:
    """The saved directory's config, dispatched to the family's class with a prefix from its folder name
    (an explicit one wins)."""
    family = get_plugin_manager().family(config.model_type)
    distributed = AutoDistributedConfig.from_pretrained(path)
    expected_prefix = (
        get_plugin_manager().family_hooks(distributed).dht_prefix(model_id=folder_name, config=distributed)
    )
    assert type(distributed) is family.config_class, f"dispatched to {type(distributed)}"
    assert distributed.dht_prefix == validate_dht_prefix(expected_prefix)
    assert (
        AutoDistributedConfig.from_pretrained(path, dht_prefix="chosen-prefix").dht_prefix == "chosen-prefix"
    )
    return distributed


def _served_specs(config: PretrainedConfig) -> list[CacheSpec]:
    """Each block's cache spec (as the kit keeps windows: ``_kit_spec``), a kind the server serves."""
    specs = [_kit_spec(cache_spec(config, index)) for index in range(config.num_hidden_layers)]
    for index, spec in enumerate(specs):
        manager_for(spec, f"{config.model_type} block {index}")
    return specs


def _kit_spec(spec: CacheSpec) -> CacheSpec:
    if isinstance(spec, HybridSpec):
        return dataclasses.replace(spec, attention=_kit_spec(spec.attention))
    if isinstance(spec, SlidingWindowSpec):
        return dataclasses.replace(spec, rewind_margin=KIT_REWIND_MARGIN)
    return spec


def _open_caches(specs: list[CacheSpec], batch_size: int, max_length: int, **kwargs) -> list:
    return [
        open_cache(spec, batch_size, max_length, layer_index=index, **kwargs)
        for index, spec in enumerate(specs)
    ]


def _implementations(model: torch.nn.Module | PretrainedConfig) -> str:
    config = getattr(model, "config", model)
    return (
        f"attention {getattr(config, '_attn_implementation', None)}, "
        f"experts {getattr(config, '_experts_implementation', None)}"
    )


def _save_random_model(config: PretrainedConfig, path: Path, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # a state-space or linear-attention head decays its state by exp(-exp(A_log) ...) a token, and
            # random A_log forgets within a token or two: a state served wrong would hardly show. Slow decay
            # keeps the session's history in the state, so the kit sees a wrong one
            if name.endswith("A_log"):
                parameter.fill_(math.log(0.01))
    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class _TwoServers(LayerListStandIn):
    """Stands in for the whole layer list: runs our blocks, split in two halves with separate caches."""

    def __init__(self, blocks: list[torch.nn.Module], config: PretrainedConfig) -> None:
        super().__init__()
        self.blocks = blocks  # a plain list: not registered, so the HF model's state is untouched
        self.config = config
        self.output_is_tuple = config.block_output_is_tuple
        self.caches: list | None = None

    def layer_list_config(self) -> PretrainedConfig:
        return self.config

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        caches = self.caches if self.caches is not None else [None] * len(self.blocks)
        shared = {}  # one pass: what layers that share keys and values hand on (see shared_kv_kwargs)
        for block, cache in zip(self.blocks, caches, strict=True):
            view = cache.view() if cache is not None else None
            hidden_states = block(hidden_states, view, **shared_kv_kwargs(block, shared))
        return (hidden_states, None) if self.output_is_tuple else hidden_states


@contextlib.contextmanager
def _layers_replaced(model: PreTrainedModel, block_prefix: str, chain: torch.nn.Module) -> Iterator[None]:
    parent_name, _, attribute = block_prefix.rpartition(".")
    parent = model.get_submodule(parent_name)
    original = getattr(parent, attribute)
    setattr(parent, attribute, torch.nn.ModuleList([chain]))
    try:
        yield
    finally:
        setattr(parent, attribute, original)


def _check_exactness(
    reference: PreTrainedModel,
    config: PretrainedConfig,
    blocks: list[torch.nn.Module],
    specs: list[CacheSpec],
    report: ConformanceReport,
    schedule: StepSchedule,
) -> None:
    generator = torch.Generator().manual_seed(schedule.seed)
    vocab, batch_size, atol = config.vocab_size, schedule.batch_size, schedule.atol
    inputs = [torch.randint(0, vocab, (batch_size, n), generator=generator) for n in schedule.step_lengths]
    chain = _TwoServers(blocks, config)  # its caches start as None: no cache
    compare = functools.partial(_compare_logits, report, config.model_type, atol, blocks[0], reference)

    ours = functools.partial(_ours, reference, config.block_prefix, chain)

    with torch.no_grad():
        full_sequence = torch.cat(inputs, dim=1)
        without_cache = reference(input_ids=full_sequence, use_cache=False).logits
        compare("forward without cache", without_cache, ours(full_sequence))

        reference_cache = DynamicCache(config=reference.config)
        server_caches = _open_caches(specs, batch_size, schedule.max_length)
        half = len(blocks) // 2
        assert {id(c) for c in server_caches[:half]}.isdisjoint(id(c) for c in server_caches[half:])
        chain.caches = server_caches
        for index, input_ids in enumerate(inputs):
            expected = _cached_step(reference, input_ids, reference_cache)
            compare(f"step {index} ({input_ids.shape[1]} tokens)", expected, ours(input_ids))
        assert all(cache.position == full_sequence.shape[1] for cache in server_caches)
        _check_held(config, specs, server_caches)

        # beam search: servers reorder their caches by hypo_ids, as transformers reorders its cache
        hypo_ids = torch.arange(batch_size - 1, -1, -1)
        reference_cache.reorder_cache(hypo_ids)
        for cache in server_caches:
            cache.reorder(hypo_ids)
        next_ids = torch.randint(0, vocab, (batch_size, 1), generator=generator)
        expected = _cached_step(reference, next_ids, reference_cache)
        compare("step after hypo_ids reorder", expected, ours(next_ids))

        # start_from_position: rewinding forgets the last step; replaying it gives the same logits
        for cache in server_caches:
            cache.rewind(cache.position - 1)
        compare("step replayed after rewind", expected, ours(next_ids))

        _check_resume_and_failover(
            chain,
            ours,
            compare,
            specs,
            schedule,
            server_caches,
            full_sequence[hypo_ids],
            without_cache[hypo_ids],
            next_ids,
            expected,
        )


def _ours(
    reference: PreTrainedModel, block_prefix: str, chain: _TwoServers, input_ids: torch.Tensor
) -> torch.Tensor:
    """Our blocks in transformers' model, given the step's positions as a client gives them."""
    position = chain.caches[0].position if chain.caches else 0
    with _layers_replaced(reference, block_prefix, chain):
        return reference(
            input_ids=input_ids, use_cache=False, **_positions(reference, input_ids, position)
        ).logits


def _cached_step(reference: PreTrainedModel, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """transformers' logits for a step on its cache, the step's positions given as ``generate`` gives them
    (a model may number a step's tokens from 0 when it is given none)."""
    positions = _positions(reference, input_ids, cache.get_seq_length())
    return reference(input_ids=input_ids, cache=cache, use_cache=True, **positions).logits


def _positions(reference: PreTrainedModel, input_ids: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
    """``position_ids`` from ``start`` on, where the model takes them."""
    if "position_ids" not in inspect.signature(reference.forward).parameters:
        return {}
    return {"position_ids": torch.arange(start, start + input_ids.shape[1]).expand_as(input_ids)}


def _check_resume_and_failover(
    chain: _TwoServers,
    ours: Callable[[torch.Tensor], torch.Tensor],
    compare: Callable[[str, torch.Tensor, torch.Tensor], None],
    specs: list[CacheSpec],
    schedule: StepSchedule,
    server_caches: list,
    history: torch.Tensor,
    history_logits: torch.Tensor,
    next_ids: torch.Tensor,
    expected: torch.Tensor,
) -> None:
    # a kept session continued from further back: every block goes back as far towards three tokens
    # back as all of them can (``resumable``: a window's margin, a state's snapshots, or 0), and the
    # tokens from there, replayed as one step, end in the same logits
    tokens = torch.cat([history, next_ids], dim=1)
    back = furthest_common(server_caches, tokens.shape[1] - 3)
    for cache in server_caches:
        cache.rewind(back)
    compare(f"step resumed at position {back}", expected, ours(tokens[:, back:])[:, -1:])

    # failover: a fresh server is handed the session's whole history (its beams reordered) as one
    # step, as the client replays it, then computes the next step as the lost server did
    chain.caches = _open_caches(specs, history.shape[0], schedule.max_length)
    compare("history replayed onto fresh caches", history_logits, ours(history))
    compare("step after the replayed history", expected, ours(next_ids))


def _compare_logits(
    report: ConformanceReport,
    model_type: str,
    atol: float,
    block: torch.nn.Module,
    reference: PreTrainedModel,
    name: str,
    expected: torch.Tensor,
    got: torch.Tensor,
) -> None:
    """Record the largest difference of ``got`` from ``expected``; fail above ``atol``, naming the attention
    and experts implementations of the block and of transformers' model."""
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    diff = (got - expected).abs().max().item()
    report.max_abs_diff[name] = diff
    assert diff <= atol, (
        f"{model_type} {name}: max |logits diff| {diff:.3g} > {atol} (blocks: "
        f"{_implementations(block)}; transformers' model: {_implementations(reference)})"
    )


def _check_held(config: PretrainedConfig, specs: list[CacheSpec], caches: list) -> None:
    """Each cache holds what its kind keeps: its spec's bytes per token and per sequence, for no more
    tokens than it keeps (a pool's page is a page of tokens, or one sequence's state)."""
    dtype = torch.float32
    for index, (spec, cache) in enumerate(zip(specs, caches, strict=True)):
        if isinstance(spec, HybridSpec):  # its keys and values, and its state, each held as its kind's
            _check_held(config, [spec.attention, spec.state], list(cache.parts))
            continue
        name = f"{config.model_type} block {index} ({spec.describe()})"
        if spec.reads_from is not None:  # it attends with its source's keys and values
            assert cache.nbytes == 0, f"{name}: holds {cache.nbytes} bytes; its kind keeps none"
            continue
        pool = cache.pool
        page = pool.page_tokens * spec.bytes_per_token(dtype) + spec.bytes_per_sequence(dtype)
        assert pool.page_nbytes == page and pool.nbytes == pool.num_pages * page, (
            f"{name}: its pool holds {pool.nbytes} bytes in {pool.num_pages} pages of {pool.page_nbytes}; its spec "
            f"says pages of {page} bytes"
        )
        tokens = pool.max_pages(cache.position) * pool.page_tokens
        most = spec.bytes_per_sequence(dtype) + tokens * spec.bytes_per_token(dtype)
        per_sequence = cache.nbytes // cache.num_sequences
        assert per_sequence <= most, (
            f"{name}: holds {per_sequence} bytes per sequence after {cache.position} tokens; its kind keeps at most "
            f"{most}"
        )


@dataclass(frozen=True)
class _Step:
    """One inference step of one session: new hidden states, after an optional rewind and reorder."""

    hidden: torch.Tensor
    rewind_to: int | None = None
    hypo_ids: torch.Tensor | None = None


def _merged_schedule(hidden_size: int, seed: int) -> list[dict[int, _Step]]:
    """Three sessions' steps by tick: different batch sizes and prompt lengths, started at different
    ticks; the second reorders its beams and the first rewinds one token while others keep going."""
    generator = torch.Generator().manual_seed(seed)

    def hidden(batch_size: int, length: int) -> torch.Tensor:
        return torch.randn(batch_size, length, hidden_size, generator=generator)

    sessions = []
    for batch_size, prefill, start in ((1, 5, 0), (2, 2, 1), (1, 9, 4)):
        steps = {start: _Step(hidden(batch_size, prefill))}
        steps.update({tick: _Step(hidden(batch_size, 1)) for tick in range(start + 1, 9)})
        sessions.append(steps)
    sessions[1][6] = _Step(hidden(2, 1), hypo_ids=torch.tensor([1, 0]))
    sessions[0][7] = _Step(hidden(1, 1), rewind_to=5 + 5)  # forgets the step of tick 6
    return sessions


def _check_merged_sessions(
    config: PretrainedConfig,
    blocks: list[torch.nn.Module],
    specs: list[CacheSpec],
    report: ConformanceReport,
    schedule: StepSchedule,
) -> None:
    sessions = _merged_schedule(config.hidden_size, schedule.seed)
    max_length = 16
    solo: list[dict[int, torch.Tensor]] = []
    with torch.no_grad():
        for steps in sessions:
            batch_size = next(iter(steps.values())).hidden.shape[0]
            caches = _open_caches(specs, batch_size, max_length)
            solo.append({tick: _run_step(blocks, [caches], [step]) for tick, step in steps.items()})

        batch_sizes = [next(iter(steps.values())).hidden.shape[0] for steps in sessions]
        arena, pools = _pools_on_one_arena(specs, batch_sizes, max_length)
        caches = [
            [
                open_cache(pool.spec, batch_size, max_length, pool=pool, layer_index=i)
                for i, pool in enumerate(pools)
            ]
            for batch_size in batch_sizes
        ]
        worst = 0.0
        for tick in range(max(max(steps) for steps in sessions) + 1):
            running = [index for index, steps in enumerate(sessions) if tick in steps]
            for length in {sessions[index][tick].hidden.shape[1] for index in running}:
                group = [index for index in running if sessions[index][tick].hidden.shape[1] == length]
                outputs = _run_step(blocks, [caches[i] for i in group], [sessions[i][tick] for i in group])
                for index, output in zip(
                    group, outputs.split([caches[i][0].num_sequences for i in group]), strict=True
                ):
                    diff = (output - solo[index][tick]).abs().max().item()
                    worst = max(worst, diff)
                    assert diff <= schedule.atol, (
                        f"{config.model_type}: session {index} at tick {tick}, merged with sessions {group}, "
                        f"differs from its solo run by {diff:.3g} > {schedule.atol}"
                    )
        report.merged_sessions_diff = worst
        for session_caches in caches:
            for cache in session_caches:
                cache.release()
        assert arena.free_pages == arena.num_pages, "released caches kept pages"


# the batching check's pages: 3 tokens of the widest keys and values, so that steps cross page edges
MERGED_PAGE_TOKENS = 3


def _page_nbytes(specs: list[CacheSpec]) -> int:
    """The page of an arena that the blocks of ``specs`` share (``page_nbytes_for`` their pages' demands)."""
    return page_nbytes_for(
        [
            demand
            for spec in specs
            for demand in manager_for(spec).page_demand(spec, torch.float32, MERGED_PAGE_TOKENS)
        ]
    )


def _pools_on_one_arena(
    specs: list[CacheSpec], batch_sizes: list[int], max_length: int
) -> tuple[PageArena, list]:
    """The blocks' pools on one arena of equal-byte pages, as a server keeps them: small pages (3 tokens of
    the widest keys and values: steps cross page edges, unless a state's page is larger), each block's in a
    stretch of its own where it looks for them first, of as many pages as the sessions (``batch_sizes``
    sequences, at most ``max_length`` tokens each) ever take there: sized in bytes by what the check runs."""
    page_nbytes = _page_nbytes(specs)
    layout = _make_pools(specs, PageArena(1, page_nbytes), [0] * len(specs))  # the tokens a page holds
    stretches = [sum(batch_sizes) * _pages_per_sequence(pool, max_length) for pool in layout]
    arena = PageArena(max(1, sum(stretches)), page_nbytes)
    return arena, _make_pools(specs, arena, [sum(stretches[:index]) for index in range(len(specs))])


def _make_pools(specs: list[CacheSpec], arena: PageArena, homes: list[int]) -> list:
    return [
        manager_for(spec).make_pool(spec, 0, 0, torch.float32, "cpu", arena=arena, home=home)
        for spec, home in zip(specs, homes, strict=True)
    ]


def _pages_per_sequence(pool, length: int) -> int:
    """The pages one sequence of ``length`` tokens takes of ``pool``'s parts over the check: each page of its
    tokens (a window gives pages back, and takes no more than that), and, where its pages grow with its
    tokens, one more, taken again after a rewind (a state's one page is kept). A pool never looks past its
    stretch then: its pages lie as they would in an arena of any size."""
    return sum(
        max(part.pages_for(length), part.max_pages(length)) + (part.pages_for(length) > part.pages_for(0))
        for part in pool.parts
    )


def _run_step(blocks: list[torch.nn.Module], session_caches: list[list], steps: list[_Step]) -> torch.Tensor:
    """One step of each session (the same number of new tokens), all in one forward per block."""
    for caches, step in zip(session_caches, steps, strict=True):
        for cache in caches:
            if step.rewind_to is not None:
                cache.rewind(step.rewind_to)
            if step.hypo_ids is not None:
                cache.reorder(step.hypo_ids)
    hidden, shared = torch.cat([step.hidden for step in steps]), {}
    for index, block in enumerate(blocks):
        members = [caches[index] for caches in session_caches]
        hidden = block(hidden, type(members[0]).merged(members), **shared_kv_kwargs(block, shared))
    return hidden
