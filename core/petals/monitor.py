"""The web monitor behind ``petals monitor``: a page, the ``/api/v1/state`` JSON and Prometheus metrics.

A ``StateUpdater`` refreshes the ``SwarmState`` every ``update_period`` on the client network's
event loop; the ASGI app (FastAPI on uvicorn) only reads the latest state, except
``/api/v1/is_reachable/<peer_id>``, which dials that peer when asked. Routes follow the original
health.petals.dev: ``/``, ``/api/v1/state``, ``/api/v1/is_reachable/<peer_id>``, ``/metrics``
(also ``/api/prometheus``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from hivemind.p2p import PeerID
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from petals.network.client import ClientNetwork
from petals.swarm_state import ModelReport, SwarmState, fetch_swarm_state, reach_error

logger = logging.getLogger(__name__)

SERVER_STATES = ("online", "joining", "offline", "unreachable")
# one sample per model, labelled with its DHT prefix: (name, help, the value from the model's report)
MODEL_GAUGES: tuple[tuple[str, str, Callable[[ModelReport], float]], ...] = (
    ("petals_swarm_blocks", "Blocks of the model", lambda report: report.num_blocks),
    (
        "petals_swarm_blocks_online",
        "Blocks served by at least one ONLINE server",
        lambda report: sum(map(bool, report.servers_per_block())),
    ),
    (
        "petals_swarm_block_servers_online_min",
        "ONLINE servers of the least covered block",
        lambda report: min(report.servers_per_block()),
    ),
    ("petals_swarm_healthy", "1 if every block is served", lambda report: report.healthy),
)


class StateUpdater:
    """Keeps ``state`` fresh: one fetch per ``update_period`` on the network loop."""

    def __init__(
        self, network: ClientNetwork, initial_peers: Sequence[str], model: str | None, update_period: float
    ) -> None:
        self.network, self.initial_peers, self.model = network, initial_peers, model
        self.update_period = update_period
        self.state: SwarmState | None = None
        self.ready = threading.Event()
        self._task = asyncio.run_coroutine_threadsafe(self._run(), network.loop)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.state = await fetch_swarm_state(
                    self.network.node,
                    self.network.p2p,
                    self.initial_peers,
                    model=self.model,
                    update_period=self.update_period,
                )
                self.ready.set()
            except Exception as error:  # a bad update keeps the last state; the next one may succeed
                logger.warning("Could not update the swarm state: %s: %s", type(error).__name__, error)
            await asyncio.sleep(max(0.0, self.update_period - (time.monotonic() - started)))

    def stop(self) -> None:
        self._task.cancel()


def create_app(updater: StateUpdater) -> FastAPI:
    app = FastAPI(title="Petals swarm monitor", docs_url=None, redoc_url=None, openapi_url=None)
    page = resources.files("petals").joinpath("monitor.html").read_text()
    registry = CollectorRegistry()
    registry.register(SwarmCollector(updater))

    @app.get("/", response_class=HTMLResponse)
    def main_page() -> str:
        return page

    @app.get("/api/v1/state")
    def api_v1_state() -> JSONResponse:
        if updater.state is None:
            return JSONResponse({"error": "the first swarm update is still running"}, status_code=503)
        return JSONResponse(updater.state.to_json())

    @app.get("/api/v1/is_reachable/{peer_id}")
    async def api_v1_is_reachable(peer_id: str, request: Request) -> JSONResponse:
        your_ip = request.client.host if request.client else None
        try:
            peer = PeerID.from_base58(peer_id)
        except ValueError:
            message = f"{peer_id!r} is not a base58 peer id"
            return JSONResponse({"success": False, "message": message, "your_ip": your_ip}, status_code=400)
        dial = asyncio.run_coroutine_threadsafe(reach_error(updater.network.p2p, peer), updater.network.loop)
        error = await asyncio.wrap_future(dial)
        return JSONResponse({"success": error is None, "message": error, "your_ip": your_ip})

    @app.get("/metrics")
    @app.get("/api/prometheus")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class SwarmCollector:
    """Prometheus gauges computed from the latest ``SwarmState`` at scrape time."""

    def __init__(self, updater: StateUpdater) -> None:
        self.updater = updater

    def collect(self) -> Iterator[Metric]:
        state = self.updater.state
        if state is None:
            return
        yield _gauge(
            "petals_swarm_models", "Models announced in _petals.models", [], [([], len(state.models))]
        )
        yield _gauge(
            "petals_swarm_bootstrap_peers",
            "Initial peers by reachability",
            ["state"],
            [([name], state.bootstrap_states.count(name)) for name in ("online", "unreachable")],
        )
        yield _gauge(
            "petals_swarm_update_duration_seconds",
            "Seconds the last update took",
            [],
            [([], state.update_duration)],
        )
        yield _gauge(
            "petals_swarm_last_updated_timestamp_seconds",
            "Unix time of the last update",
            [],
            [([], state.last_updated)],
        )
        yield from self._model_gauges(state)
        yield from self._server_gauges(state)

    def _model_gauges(self, state: SwarmState) -> Iterator[Metric]:
        reports = state.models
        for name, documentation, value in MODEL_GAUGES:
            yield _gauge(name, documentation, ["model"], [([r.dht_prefix], value(r)) for r in reports])
        yield _gauge(
            "petals_swarm_servers",
            "Servers of the model by state",
            ["model", "state"],
            [
                ([r.dht_prefix, name], sum(row.state == name for row in r.rows))
                for r in reports
                for name in SERVER_STATES
            ],
        )

    def _server_gauges(self, state: SwarmState) -> Iterator[Metric]:
        rows = [(report.dht_prefix, row) for report in state.models for row in report.rows]
        yield _gauge(
            "petals_swarm_server_blocks",
            "Blocks a server hosts, labelled with its state",
            ["model", "peer_id", "state"],
            [([model, row.peer_id.to_base58(), row.state], row.span.length) for model, row in rows],
        )
        yield _gauge(
            "petals_swarm_server_throughput",
            "A server's announced throughput (tokens/s)",
            ["model", "peer_id"],
            [([model, row.peer_id.to_base58()], row.span.throughput) for model, row in rows],
        )
        yield _gauge(
            "petals_swarm_server_cache_tokens_left_per_block",
            "KV cache tokens a server can still hold per block",
            ["model", "peer_id"],
            [
                ([model, row.peer_id.to_base58()], row.cache_tokens_left_per_block)
                for model, row in rows
                if row.cache_tokens_left_per_block is not None
            ],
        )
        yield _gauge(
            "petals_swarm_server_kv_cache_bytes",
            "A server's KV-cache budget, and the bytes its sessions hold of it by cache kind",
            ["model", "peer_id", "use"],
            [
                ([model, row.peer_id.to_base58(), use], nbytes)
                for model, row in rows
                if row.span.server_info.cache_bytes is not None
                for use, nbytes in [
                    ("budget", row.span.server_info.cache_bytes),
                    *(row.span.server_info.cache_bytes_held or {}).items(),
                ]
            ],
        )


def _gauge(
    name: str, documentation: str, labels: list[str], samples: list[tuple[list[str], float]]
) -> Metric:
    gauge = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in samples:
        gauge.add_metric(values, float(value))
    return gauge
