"""A Petals server's life: join the swarm, choose blocks, load them, serve, rebalance, leave.

Everything runs in one asyncio loop of one process (plus hivemind's p2pd daemon): one ``P2P``, a
``DHTNode`` on it, the handler's RPCs on it, and one compute thread for torch. The server announces
its blocks as JOINING while loading, ONLINE while serving and OFFLINE when it leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hivemind.dht import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from tqdm import tqdm

import petals
from petals.block import closed_boundaries
from petals.convert import block_weight_bytes, convert_block
from petals.data_structures import ModelInfo, ServerInfo, ServerState, make_uids
from petals.dht import (
    create_node,
    declare_active_modules,
    declare_model,
    expiration_from_now,
    get_remote_module_infos,
)
from petals.formats import stored_as, weights_note
from petals.formats.gguf import release_readers
from petals.loading import load_block, open_checkpoint
from petals.membership import load_membership
from petals.network.p2p import DaemonGone, daemon_alive, leave_network, while_daemon_lives
from petals.policies.placement import MoveHistory, shared_groups
from petals.reachability import ReachabilityProtocol, check_direct_reachability
from petals.server.backend import BlockBackend, HostedBlocks
from petals.server.block_selection import choose_best_blocks, decide_move, make_placement
from petals.server.cache_budget import CacheBudget
from petals.server.engine import ComputeThread, ServingEngine
from petals.server.handler import TransformerConnectionHandler
from petals.server.metrics import NO_METRICS, NoMetrics
from petals.server.pings import NextPings
from petals.server.scheduler import Scheduler
from petals.server.settings import ServerSettings
from petals.server.throughput import hosted_throughput
from petals.server.validation import Limits

logger = logging.getLogger(__name__)

READY_MESSAGE = "Server is ONLINE"  # logged once serving; petals.local_swarm waits for it
# leaving a span (stop or rebalancing) takes at most this long, however the network behaves; then
# stopping p2pd takes up to 1 s more (``leave_network``): a stop signal is done with in < 5 s
LEAVE_SECONDS = 3.0


class Server:
    def __init__(self, settings: ServerSettings, metrics: NoMetrics = NO_METRICS) -> None:
        """``settings`` as decided by ``petals.server.planning.resolve_settings``; ``metrics`` its own
        (``ServerMetrics.serve``) or none."""
        self.settings, self.metrics = settings, metrics
        self.config = settings.load_config()
        # the checkpoint's stored format (log, health), None for plain weights
        self.stored_as = stored_as(settings.model, self.config)
        self.dht_prefix: str = self.config.dht_prefix
        self.total_blocks: int = self.config.num_hidden_layers
        # between layers that share keys and values: no span of blocks may begin or end there
        self.closed = closed_boundaries(self.config)
        self.all_uids = make_uids(self.dht_prefix, 0, self.total_blocks)
        self.expiration = settings.expiration or max(2 * settings.update_period, 3)
        self.stop = asyncio.Event()
        self.online = asyncio.Event()  # set once the server has first announced ONLINE
        self.using_relay = False  # set on joining: reachable only through a relay
        self.peer_id: PeerID | None = None  # set on joining
        self.span: ServingSpan | None = None  # the blocks it serves now
        self.membership = load_membership(settings.network, role="server")  # None in a public swarm
        self.placement = make_placement(
            settings.placement, settings.balance_quality, settings.mean_balance_check_period
        )
        self.placement_rng = np.random.default_rng()
        self.move_history = MoveHistory()

    async def run(self) -> None:
        """Serve until ``stop`` is set, then leave the swarm cleanly (within ~``LEAVE_SECONDS`` + 1 s)."""
        started = time.perf_counter()
        p2p = await self.settings.network.create_p2p()
        self.peer_id = p2p.peer_id
        node = None
        try:
            node = await create_node(
                p2p, self.settings.network.initial_peers, self.membership, num_workers=self.total_blocks
            )
            if self.membership is not None:
                await self.membership.present_certificate(p2p)
            visible = await p2p.get_visible_maddrs()
            self.using_relay = is_relayed(visible)
            maddrs = " ".join(map(str, visible))
            logger.info(
                "Joined the swarm in %.1f s as %s (%s)", time.perf_counter() - started, p2p.peer_id, maddrs
            )
            await ReachabilityProtocol(p2p).add_p2p_handlers(p2p)  # answer other peers' checks
            await self._serve(p2p, node)
        finally:
            await leave_network(p2p, node)
            logger.info("Left the swarm")

    async def _serve(self, p2p: P2P, node: DHTNode) -> None:
        checking = asyncio.create_task(self._check_reachability(p2p, node))
        refreshing = (
            asyncio.create_task(
                self.membership.keep_fresh(node, self.settings.update_period, self.expiration)
            )
            if self.membership is not None
            else None
        )
        # one policy for every span: what it learned of thread counts holds for the next blocks too
        scheduler = Scheduler(
            torch.get_num_threads(),
            merge_window=self.settings.merge_window,
            small_task_threads=self.settings.decode_threads or 0,
        )
        try:
            blocks = await self._choose_blocks(node)
            while blocks is not None and not self.stop.is_set():
                span = self.span = ServingSpan(self, p2p, node, scheduler, blocks)
                try:
                    if not await self._until_stopped(span.start()):
                        break
                    blocks = await span.serve_until_moved()
                finally:
                    await span.leave()
        finally:
            checking.cancel()
            if refreshing is not None:
                refreshing.cancel()

    async def _check_reachability(self, p2p: P2P, node: DHTNode) -> None:
        """Ask DHT neighbours to dial back; if they cannot, others reach us only through relays."""
        if (
            self.using_relay
            or self.settings.skip_reachability_check
            or not self.settings.network.initial_peers
            or all(is_loopback(maddr) for maddr in await p2p.get_visible_maddrs())
        ):
            return  # a loopback-only peer is reachable from this machine alone: nothing to ask
        neighbours = list(node.protocol.routing_table.peer_id_to_uid)
        if await check_direct_reachability(p2p, neighbours) is False:
            self.using_relay = True  # announced from the next update on
            logger.warning(
                "Other peers cannot connect to this server directly (it is behind NAT or a firewall, or "
                "announces addresses they cannot reach): clients reach it only through relays, if any. "
                "Open a TCP port and pass --port PORT --public_ip YOUR_IP"
            )

    async def _until_stopped(self, coroutine) -> bool:
        """Run ``coroutine`` unless the server is stopped first (then cancel it and return False)."""
        task, stopped = asyncio.create_task(coroutine), asyncio.create_task(self.stop.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not task.done():
            task.cancel()
            return False
        task.result()
        return True

    async def _choose_blocks(self, node: DHTNode) -> range:
        if self.settings.block_indices is not None:
            return self.settings.block_indices
        infos = await get_remote_module_infos(node, self.all_uids, latest=True)
        return choose_best_blocks(self.settings.num_blocks, infos, self.placement, self.closed)

    def server_info(
        self,
        state: ServerState,
        blocks: range,
        budget: CacheBudget | None,
        weight_bytes: int | None = None,
        next_pings: dict[str, float] | None = None,
    ) -> ServerInfo:
        return ServerInfo(
            state=state,
            throughput=float(self.settings.throughput.throughput),
            start_block=blocks.start,
            end_block=blocks.stop,
            public_name=self.settings.public_name,
            version=petals.__version__,
            forward_rps=self.settings.throughput.forward_rps,
            inference_rps=self.settings.throughput.inference_rps,
            adapters=self.settings.adapters,
            torch_dtype=str(self.settings.dtype).removeprefix("torch."),
            quant_type=self.settings.quant_type,
            using_relay=self.using_relay,
            cache_tokens_left=budget.tokens_left if budget is not None else None,
            cache_bytes=budget.nbytes if budget is not None else None,
            cache_bytes_held=budget.bytes_by_kind() if budget is not None else None,
            cache_pages=budget.page_counts() if budget is not None else None,
            sessions_preempted=budget.lender.preemptions if budget is not None else None,
            next_pings=next_pings,
            weight_bytes=weight_bytes,
            dequantized_from=self.stored_as if self.settings.weights == "dequantized" else None,
            packed_as=self.stored_as if self.settings.weights == "packed" else None,
        )

    def model_info(self) -> ModelInfo:
        model = self.settings.model
        # a local folder or file (a GGUF) has no public page; a hub id does
        repository = None if Path(model).exists() else f"https://huggingface.co/{model}"
        return ModelInfo(num_blocks=self.total_blocks, repository=repository)


class ServingSpan:
    """One stint of serving one range of blocks: load, announce, serve, rebalance check, leave."""

    def __init__(self, server: Server, p2p: P2P, node: DHTNode, scheduler: Scheduler, blocks: range) -> None:
        self.server, self.p2p, self.node, self.scheduler, self.blocks = server, p2p, node, scheduler, blocks
        self.settings = server.settings
        self.uids = make_uids(server.dht_prefix, blocks.start, blocks.stop)
        self.state = ServerState.JOINING
        self.budget: CacheBudget | None = None
        self.weight_bytes: int | None = None
        self.engine: ServingEngine | None = None
        self.compute: ComputeThread | None = None
        self.handler: TransformerConnectionHandler | None = None
        self._announcer: asyncio.Task | None = None
        self._announced_until: float | None = None  # DHT time when our last JOINING/ONLINE records expire
        next_uid = f"{server.dht_prefix}.{blocks.stop}" if blocks.stop < server.total_blocks else None
        self.pings = NextPings(p2p, next_uid)

    async def start(self) -> None:
        logger.info(
            "Hosting blocks %d:%d of %s (%d blocks in the model)",
            self.blocks.start,
            self.blocks.stop,
            self.server.dht_prefix,
            self.server.total_blocks,
        )
        self._log_shared_groups()
        self._announcer = asyncio.create_task(self._announce_periodically())
        await self._announce(ServerState.JOINING)
        hosted = HostedBlocks(await asyncio.to_thread(self._load_blocks))
        await asyncio.to_thread(self._measure_packed_throughput, hosted)
        self.weight_bytes = sum(block_weight_bytes(backend.module) for backend in hosted.backends.values())
        logger.info(
            "Weight memory: %.2f MiB (%d bytes) for %d blocks, quant_type %s",
            self.weight_bytes / 2**20,
            self.weight_bytes,
            len(hosted),
            self.settings.quant_type,
        )
        self.budget = CacheBudget(list(hosted.backends.values()), self.settings.attn_cache_tokens)
        metrics = self.server.metrics
        self.engine = self._engine(hosted, metrics)
        self.compute = ComputeThread(self.engine).start()
        membership = self.server.membership
        self.handler = TransformerConnectionHandler(
            self.engine,
            self.p2p,
            client_mode=self.node.protocol.client_mode,
            metrics=metrics,
            admission=membership.guard(self.p2p) if membership is not None else None,
        )
        await self.handler.add_p2p_handlers(self.p2p)
        metrics.serving = self.engine
        await self._announce(ServerState.ONLINE)
        self.server.online.set()
        logger.info(
            "%s: blocks %d:%d, %s on %s, KV cache of %.1f MiB (%d tokens per block, shared by every block)",
            READY_MESSAGE,
            self.blocks.start,
            self.blocks.stop,
            str(self.settings.dtype).removeprefix("torch."),
            ", ".join(map(str, self.settings.tensor_parallel_devices or [self.settings.device])),
            self.budget.nbytes / 2**20,
            self.settings.attn_cache_tokens,
        )

    def _log_shared_groups(self) -> None:
        """Say which hosted blocks are served together because later layers reuse earlier ones' keys and
        values: why this span could not begin or end between them."""
        groups = [
            f"{group.start}:{group.stop}"
            for group in shared_groups(self.server.closed)
            if self.blocks.start < group.stop and group.start < self.blocks.stop
        ]
        if groups:
            logger.info(
                "Blocks %s share keys and values (later layers attend with those of earlier ones): "
                "they are served together",
                ", ".join(groups),
            )

    def _engine(self, hosted: HostedBlocks, metrics: NoMetrics) -> ServingEngine:
        limits = Limits(
            max_batch_size=self.settings.max_batch_size,
            inference_max_length=self.settings.inference_max_length,
            request_timeout=self.settings.request_timeout,
            session_timeout=self.settings.session_timeout,
            step_timeout=self.settings.step_timeout,
            adapters=self.settings.adapters,
        )
        return ServingEngine(
            hosted,
            self.budget,
            limits,
            self.scheduler,
            dht_prefix=self.server.dht_prefix,
            metrics=metrics,
            backward_graph_bytes=self.settings.backward_graph_budget,
        )

    def _measure_packed_throughput(self, hosted: HostedBlocks) -> None:
        """Announce what packed blocks compute, not what the dense random block measured at start did
        (a packed block dequantizes per forward: several times slower on CPU): measured on a hosted block,
        unless the throughput was given as a number."""
        settings = self.settings
        if (
            settings.weights != "packed"
            or self.server.stored_as is None
            or settings.throughput.forward_rps is None
        ):
            return
        backend = next(iter(hosted.backends.values()))
        throughput = hosted_throughput(
            backend, settings, self.server.config, len(self.blocks), self.server.stored_as
        )
        self.settings = self.server.settings = dataclasses.replace(settings, throughput=throughput)

    def _load_blocks(self) -> list[BlockBackend]:
        checkpoint = open_checkpoint(
            self.settings.model,
            cache_dir=self.settings.cache_dir,
            token=self.settings.token,
            revision=self.settings.revision,
            max_disk_space=self.settings.max_disk_space,
        )
        stored = self.server.stored_as
        if stored is not None:
            logger.info(
                "%s",
                weights_note(
                    stored,
                    self.settings.weights,
                    self.settings.dtype,
                    self.settings.device,
                    self.settings.quant_type,
                ),
            )
        hub_kwargs = {"cache_dir": self.settings.cache_dir, "token": self.settings.token}
        started = time.perf_counter()
        progress = tqdm(total=len(self.blocks), desc="Loading blocks", unit="block", file=sys.stderr)
        with _cleared_on_failure(progress):
            backends = self._load_each(checkpoint, progress, hub_kwargs)
        logger.info("Loaded %d blocks in %.2f s", len(self.blocks), time.perf_counter() - started)
        release_readers()  # a GGUF file's parsed metadata and mapped pages: the blocks hold copies
        return backends

    def _load_each(self, checkpoint, progress: tqdm, hub_kwargs: dict) -> list[BlockBackend]:
        backends, loaded_bytes = [], 0
        for count, index in enumerate(self.blocks, start=1):
            block = load_block(
                self.settings.model,
                index,
                self.settings.dtype,
                config=self.server.config,
                checkpoint=checkpoint,
                weights=self.settings.weights,
            )
            module = convert_block(
                block,
                index,
                self.server.config,
                dtype=self.settings.dtype,
                device=self.settings.device,
                quant_type=self.settings.quant_type,
                tensor_parallel_devices=self.settings.tensor_parallel_devices,
                adapters={name: name for name in self.settings.adapters},
                **hub_kwargs,
            )
            backends.append(
                BlockBackend(
                    self.uids[count - 1],
                    index,
                    module,
                    self.server.config,
                    self.settings.dtype,
                    self.settings.device,
                )
            )
            loaded_bytes += block_weight_bytes(module)
            progress.set_postfix_str(f"block {index}, {loaded_bytes / 2**20:.1f} MiB", refresh=False)
            progress.update()
        return backends

    async def serve_until_moved(self) -> range | None:
        """Serve until the server stops (→ None) or should move to other blocks (→ the new range)."""
        next_stats = time.monotonic() + self.settings.stats_period
        next_check = time.monotonic() + self._balance_delay()
        tokens_before = self.engine.tokens_processed
        while True:
            wake_at = min(next_stats, next_check)
            try:
                await asyncio.wait_for(self.server.stop.wait(), max(0.0, wake_at - time.monotonic()))
                return None
            except TimeoutError:
                pass
            now = time.monotonic()
            if now >= next_stats:
                tokens = self.engine.tokens_processed
                self._log_stats((tokens - tokens_before) / self.settings.stats_period)
                tokens_before, next_stats = tokens, now + self.settings.stats_period
            if now >= next_check:
                next_check = now + self._balance_delay()
                new_blocks = await self._new_blocks()
                if new_blocks is not None:
                    return new_blocks

    async def _new_blocks(self) -> range | None:
        if self.settings.block_indices is not None:
            return None
        infos = await get_remote_module_infos(self.node, self.server.all_uids, latest=True)
        server = self.server
        decision = decide_move(
            self.p2p.peer_id,
            infos,
            server.placement,
            balance_quality=self.settings.balance_quality,
            now=time.monotonic(),
            rng=server.placement_rng,
            history=server.move_history,
            closed=server.closed,
        )
        logger.info("Balance check: %s", decision.reason)
        new_blocks = decision.blocks
        if new_blocks is None or new_blocks == self.blocks:
            return None
        logger.info(
            "Rebalancing: moving from blocks %d:%d to %d:%d", *_bounds(self.blocks), *_bounds(new_blocks)
        )
        server.move_history = MoveHistory(self.blocks, time.monotonic())
        return new_blocks

    def _balance_delay(self) -> float:
        return self.server.placement.check_delay(self.server.placement_rng)

    def _log_stats(self, tokens_per_second: float) -> None:
        pages = self.budget.page_counts() if self.budget else {}
        logger.info(
            "Serving %d sessions, %.1f token-blocks/s, KV cache left: %d tokens (pages: %s)",
            len(self.engine.sessions),
            tokens_per_second,
            self.budget.tokens_left if self.budget else 0,
            ", ".join(f"{count} {use}" for use, count in pages.items()) or "none",
        )

    async def leave(self) -> None:
        """Stop taking requests, end open sessions, announce OFFLINE: within ~``LEAVE_SECONDS``."""
        if self.engine is not None:
            self.engine.sessions.close_all()
        self.server.metrics.serving = None
        if self._announcer is not None:
            self._announcer.cancel()
        if self.handler is not None and daemon_alive(self.p2p):
            try:
                await while_daemon_lives(self.p2p, self.handler.remove_p2p_handlers(self.p2p), 0.5)
            except Exception as error:  # leaving must not fail; the OFFLINE step below tells what happened
                logger.debug("Could not unregister the handlers: %s", error)
        await self._announce_offline(LEAVE_SECONDS - 0.5)
        if self.compute is not None:
            self.compute.stop()

    async def _announce_offline(self, timeout: float) -> None:
        """Announce OFFLINE if the network is reachable; else say truthfully that the records just expire."""
        blocks = f"blocks {self.blocks.start}:{self.blocks.stop}"
        try:
            if not daemon_alive(self.p2p):
                raise DaemonGone()
            stored = await while_daemon_lives(self.p2p, self._announce(ServerState.OFFLINE), timeout)
        except DaemonGone:
            reason = "the network daemon (p2pd) is gone"
        except TimeoutError:
            reason = f"no answer from the DHT within {timeout:.1f} s"
        except Exception as error:  # leaving must not fail; the records expire anyway
            reason = str(error) or type(error).__name__
        else:
            if all(stored.values()):
                logger.info("Announced OFFLINE for %s", blocks)
                return
            reason = f"the DHT did not store {sum(not ok for ok in stored.values())} of {len(stored)} records"
        logger.warning("Could not announce OFFLINE for %s: %s; %s", blocks, reason, self._records_expire())

    def _records_expire(self) -> str:
        if self._announced_until is None:
            return "nothing was announced"
        return f"the records expire in {max(0, self._announced_until - get_dht_time()):.0f} s"

    async def _announce(self, state: ServerState) -> dict[str, bool]:
        """Store this span's records in ``state``; returns which stores succeeded."""
        self.state = state
        expiration = expiration_from_now(self.server.expiration)
        if self.server.membership is not None:
            expiration = self.server.membership.cap_expiration(expiration)
        next_pings = await self._next_pings() if state == ServerState.ONLINE else None
        info = self.server.server_info(state, self.blocks, self.budget, self.weight_bytes, next_pings)
        stored = await declare_active_modules(self.node, self.uids, info, expiration)
        if state != ServerState.OFFLINE:
            if any(stored.values()):
                self._announced_until = expiration
            await declare_model(self.node, self.server.dht_prefix, self.server.model_info(), expiration)
        return stored

    async def _next_pings(self) -> dict[str, float] | None:
        try:
            return await self.pings.refresh(self.node)
        except Exception as error:  # announcing matters more than the pings
            logger.warning("Could not ping the next servers: %s", error)
            return None

    async def _announce_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.settings.update_period)
            try:
                await self._announce(self.state)
            except Exception as error:
                logger.warning("Announcing to the DHT failed: %s", error)


def is_loopback(maddr) -> bool:
    return str(maddr).startswith(("/ip4/127.", "/ip6/::1/"))


def is_relayed(maddrs) -> bool:
    """Whether every address others can reach us at goes through a relay (``/p2p-circuit``)."""
    return bool(maddrs) and all("/p2p-circuit" in str(maddr) for maddr in maddrs)


def _bounds(blocks: range) -> tuple[int, int]:
    return blocks.start, blocks.stop


@contextlib.contextmanager
def _cleared_on_failure(progress: tqdm):
    """Close ``progress`` when its work is done; on a failure clear it instead, so that the error's one
    line stays the last on screen (a closed bar is drawn once more)."""
    try:
        yield progress
    except BaseException:
        progress.leave = False
        progress.close()
        raise
    progress.close()
