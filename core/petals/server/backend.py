"""The blocks a server hosts and the torch computations it runs on them.

Everything here runs in the compute thread (``scheduler.ComputeQueue``). Inputs arrive on CPU in
the client's dtype; each block computes in the server's dtype on the server's device; outputs go
back to CPU in the server's dtype. Deep prompts ``[B|1, pre_len, H]`` are added to the first
``pre_len`` positions of a block's input, as Petals does.

A block's module is what ``petals.convert.convert_block`` made of it: plain, quantized, with LoRA
adapters (a request's ``active_adapter`` picks one: ``with_adapter``), or a ``TensorParallelBlock``
whose sessions hold one cache per shard. Sessions' caches take pages from the block's pools
(``make_pools``: one, or one per shard; sequence states for linear attention), which the server's
``CacheBudget`` owns.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from petals.block import cache_spec, shared_kv_kwargs
from petals.convert import TensorParallelBlock, using_adapter
from petals.kv_cache import (
    CacheSpec,
    HybridPool,
    Lease,
    PageArena,
    Pool,
    RowsCache,
    SessionCache,
    ShardCaches,
    manager_for,
    open_cache,
)


@dataclass(frozen=True)
class BlockGraph:
    """A block's input and output with the autograd graph between them, and the activation bytes it holds."""

    block_input: torch.Tensor
    output: torch.Tensor
    saved_bytes: int


@dataclass
class BlockBackend:
    """One hosted block: its uid, module, where and how it computes, and the LoRA adapter it applies."""

    uid: str
    index: int
    module: torch.nn.Module
    config: PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    adapter: str | None = None

    def with_adapter(self, adapter: str | None) -> BlockBackend:
        """The same block computing with LoRA adapter ``adapter`` (None: the base model)."""
        return dataclasses.replace(self, adapter=adapter or None)

    @functools.cached_property
    def cache_spec(self) -> CacheSpec:
        """What this block caches per session (the family's ``cache_spec`` hook), checked to be served."""
        spec = cache_spec(self.config, self.index)
        manager_for(spec, f"block {self.index}")  # one line now, not at the first session
        return spec

    @property
    def sharded(self) -> bool:
        """Whether the block is split over devices (its sessions hold one cache per shard)."""
        return isinstance(self.module, TensorParallelBlock)

    @property
    def devices(self) -> list[torch.device]:
        """Where this block's cache lives: one device, or one per tensor-parallel shard."""
        return list(self.module.devices) if self.sharded else [self.device]

    @property
    def shard_specs(self) -> list[CacheSpec]:
        """What each tensor-parallel shard caches (one entry without tensor parallelism)."""
        return [self.module.shard_spec] * len(self.devices) if self.sharded else [self.cache_spec]

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes of one token in this block, as allocated (all shards together)."""
        return sum(spec.bytes_per_token(self.dtype) for spec in self.shard_specs)

    def tokens_held(self, length: int) -> int:
        """The most tokens one sequence of ``length`` tokens holds in this block's cache."""
        return self.cache_spec.tokens_held(length)

    def forward(
        self, hidden: torch.Tensor, prompt: torch.Tensor | None, shared: dict | None = None
    ) -> torch.Tensor:
        """``shared``: one dict per pass over a span, for layers that share keys and values in it."""
        # no_grad, not inference_mode: rpc_backward recomputes its blocks' inputs with this, and
        # autograd cannot take inference tensors
        with torch.no_grad(), using_adapter(self.module, self.adapter) as module:
            return module(self._input(hidden, prompt), None, **shared_kv_kwargs(module, shared))

    def forward_with_graph(self, hidden: torch.Tensor, prompt: torch.Tensor | None) -> BlockGraph:
        """The block's output with its autograd graph kept, for ``backward_graph`` later."""
        block_input = self._input(hidden, prompt).detach().requires_grad_(True)
        weights = self._weight_storages
        saved = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            if tensor.untyped_storage().data_ptr() not in weights:
                saved += tensor.untyped_storage().nbytes()
            return tensor

        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
            using_adapter(self.module, self.adapter) as module,
        ):
            output = module(block_input, None, **shared_kv_kwargs(module, None))
        return BlockGraph(block_input, output, saved)

    def backward_graph(self, graph: BlockGraph, grad_output: torch.Tensor) -> torch.Tensor:
        """Gradient of ``sum(graph.output * grad_output)`` w.r.t. the block's input (prompt added)."""
        grad = grad_output.to(self.device, graph.output.dtype)
        # the same gradient, seeded by a scalar: torch checks an explicit seed's shape with its symbolic
        # shapes, whose first use imports sympy (30 MiB) into the server
        with torch.enable_grad():
            (grad_input,) = torch.autograd.grad((graph.output * grad).sum(), graph.block_input)
        return grad_input

    def backward(
        self, hidden: torch.Tensor, prompt: torch.Tensor | None, grad_output: torch.Tensor
    ) -> torch.Tensor:
        """Gradient of ``sum(output * grad_output)`` w.r.t. the block's input, recomputing the output.

        The input enters as ``hidden + prompt`` on the first positions, so this is also the deep
        prompt's gradient there (unreduced over the batch, as Petals returns it).
        """
        return self.backward_graph(self.forward_with_graph(hidden, prompt), grad_output)

    @functools.cached_property
    def _weight_storages(self) -> frozenset[int]:
        """Where the module's parameters and buffers live: autograd saves them, but they are no activations."""
        tensors = [*self.module.parameters(), *self.module.buffers()]
        return frozenset(tensor.untyped_storage().data_ptr() for tensor in tensors)

    def inference_step(
        self,
        hidden: torch.Tensor,
        prompt: torch.Tensor | None,
        cache: RowsCache | list[RowsCache],
        shared: dict | None = None,
    ) -> torch.Tensor:
        """One step of a session (``shared``: as in ``forward``). A caller running many blocks per step
        enters ``torch.inference_mode`` once around them all: entering it and the adapter context per
        block cost about 15 us a block (0.3-2.6% of a decode step over 8 tiny blocks, 0.6-1.0% over 30
        small ones, at one thread)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.inference_step(hidden, prompt, cache, shared)
        if self.adapter is None and not getattr(self.module, "petals_adapters", None):
            return self.module(self._input(hidden, prompt), cache, **shared_kv_kwargs(self.module, shared))
        with using_adapter(self.module, self.adapter) as module:
            return module(self._input(hidden, prompt), cache, **shared_kv_kwargs(module, shared))

    def allocate_cache(self, batch_size: int, max_length: int) -> SessionCache:
        """A standalone cache holding ``max_length`` tokens up front (for measurements)."""
        caches = [
            open_cache(spec, batch_size, max_length, self.dtype, device, layer_index=self.index)
            for spec, device in zip(self.shard_specs, self.devices, strict=True)
        ]
        return ShardCaches(caches) if self.sharded else caches[0]

    def make_pools(
        self,
        tokens: int,
        page_tokens: int,
        arenas: dict[torch.device, PageArena] | None = None,
        home: int = 0,
    ) -> list[Pool | HybridPool]:
        """The pools this block's sessions share (one per tensor-parallel shard), each of its kind's making:
        on the server's arena of the shard's device (``arenas``; pages looked for from ``home`` on), or of
        their own for a budget of ``tokens`` tokens in pages of ``page_tokens`` tokens (measurements)."""
        return [
            manager_for(spec).make_pool(
                spec,
                tokens,
                page_tokens,
                self.dtype,
                device,
                **({} if arenas is None else {"arena": arenas[torch.device(device)], "home": home}),
            )  # fmt: skip
            for spec, device in zip(self.shard_specs, self.devices, strict=True)
        ]

    def page_demands(self, page_tokens: int) -> list[tuple[torch.device, tuple[int, int]]]:
        """``(device, (bytes, row bytes))`` of each page this block's pools need, to hold ``page_tokens``
        tokens or a sequence's state (what the server's arenas' page sizes are made from)."""
        return [
            (torch.device(device), demand)
            for spec, device in zip(self.shard_specs, self.devices, strict=True)
            for demand in manager_for(spec).page_demand(spec, self.dtype, page_tokens)
        ]

    def open_cache(
        self, pools: list[Pool | HybridPool], batch_size: int, max_length: int, lease: Lease | None = None
    ) -> SessionCache:
        """A session's cache on ``pools`` (from ``make_pools``): it takes pages as it grows, counted on
        ``lease`` (one cache per tensor-parallel shard, used as one)."""
        caches = []
        try:
            for pool in pools:
                caches.append(
                    open_cache(
                        pool.spec, batch_size, max_length, pool=pool, layer_index=self.index, lease=lease
                    )
                )
        except BaseException:
            for cache in caches:
                cache.release()
            raise
        return ShardCaches(caches) if self.sharded else caches[0]

    def _input(self, hidden: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
        hidden = hidden.to(self.device, self.dtype)
        return add_prompt(hidden, prompt.to(self.device, self.dtype) if prompt is not None else None)


def backward_span(
    backends: list[BlockBackend],
    hidden: torch.Tensor,
    prompts: list[torch.Tensor | None],
    grad_output: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of ``sum(output * grad_output)`` w.r.t. the span's input and its blocks' deep prompts,
    through one autograd graph over all the blocks: later blocks that attend with keys and values of
    earlier ones (``shared_kv_states``) carry gradient back into those blocks, which block-by-block
    backward (``BlockBackend.backward``) would drop. Returns ``(grad_input, grad_prompts or None)``, as
    the block-by-block backward does."""
    inputs, shared = [], {}
    hidden = hidden.to(backends[0].device, backends[0].dtype).detach().requires_grad_(True)
    with torch.enable_grad():
        for backend, prompt in zip(backends, prompts, strict=True):
            block_input = backend._input(hidden, prompt)
            inputs.append(block_input)
            with using_adapter(backend.module, backend.adapter) as module:
                hidden = module(block_input, None, **shared_kv_kwargs(module, shared))
        grad = grad_output.to(hidden.device, hidden.dtype)
        grads = torch.autograd.grad((hidden * grad).sum(), inputs)
    grad_prompts = [
        grads[index][:, : prompt.shape[-2]] for index, prompt in enumerate(prompts) if prompt is not None
    ]
    return grads[0], torch.stack(grad_prompts) if grad_prompts else None


def add_prompt(hidden: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
    if prompt is None:
        return hidden
    pre_len = prompt.shape[-2]
    return torch.cat([hidden[:, :pre_len] + prompt, hidden[:, pre_len:]], dim=1)


class HostedBlocks:
    """The consecutive blocks ``[start, end)`` this server serves, by uid."""

    def __init__(self, backends: list[BlockBackend]) -> None:
        self.backends = {backend.uid: backend for backend in backends}
        self.start = min(backend.index for backend in backends)
        self.end = max(backend.index for backend in backends) + 1
        first = backends[0]
        self.config, self.dtype, self.device = first.config, first.dtype, first.device
        self.hidden_size: int = first.config.hidden_size

    def __len__(self) -> int:
        return len(self.backends)
