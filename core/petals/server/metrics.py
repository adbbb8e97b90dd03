"""A server's own Prometheus metrics, served by ``petals serve --metrics_port N`` (off by default).

Each server owns one ``ServerMetrics`` (two servers in one process share nothing); the handler and
the engine call one method of it per event (a request, a failure, an inference step, a compute
batch). With metrics off a server holds ``NO_METRICS``, whose methods do nothing. What the server
already keeps as live state (open sessions, the KV-cache budget, tokens computed, merged batches,
pushes) is read from the engine it serves only when Prometheus scrapes, so it costs the hot path
nothing. prometheus_client (the ``monitor`` extra) is imported only when metrics are turned on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from petals.server.engine import ServingEngine

logger = logging.getLogger(__name__)

STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WAIT_SECONDS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class NoMetrics:
    """A server's metrics while they are off: every event is ignored."""

    serving: ServingEngine | None = None  # the engine whose state the gauges show (read at scrape time)

    def request_started(self, rpc: str) -> None:
        pass

    def request_failed(self, rpc: str, kind: str) -> None:
        """``kind`` is what the peer was told (``wire_errors.ERROR_KINDS``): bad_request, cache_full, internal, ..."""

    def inference_step_done(self, seconds: float) -> None:
        """An inference step took ``seconds`` from its arrival to its answer."""

    def compute_batch_started(self, now: float, submitted: Sequence[float]) -> None:
        """The compute thread took, at ``now``, a batch of tasks submitted at these times (same clock)."""


NO_METRICS = NoMetrics()


class ServerMetrics(NoMetrics):
    """The metrics of one server, registered on a registry of its own."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        self.registry = registry
        self.serving = None
        self.requests = Counter(
            "petals_server_requests",
            "RPC calls received (an inference session counts once)",
            ["rpc"],
            registry=registry,
        )
        self.errors = Counter(
            "petals_server_request_errors",
            "RPC calls that failed, by exception class",
            ["rpc", "kind"],
            registry=registry,
        )
        self.step_seconds = Histogram(
            "petals_server_inference_step_seconds",
            "Seconds from receiving an inference step to its answer",
            buckets=STEP_SECONDS,
            registry=registry,
        )
        self.queue_wait_seconds = Histogram(
            "petals_server_compute_queue_wait_seconds",
            "Seconds a compute task waited in the queue",
            buckets=WAIT_SECONDS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "petals_server_compute_batch_size",
            "Tasks run together in one compute call (merged decode steps)",
            buckets=BATCH_SIZES,
            registry=registry,
        )
        registry.register(_LiveStateCollector(self))

    @classmethod
    def serve(cls, host: str, port: int | None) -> NoMetrics:
        """Metrics served at ``http://host:port/metrics`` from a background thread (no port: ``NO_METRICS``)."""
        if port is None:
            return NO_METRICS
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise click.UsageError(
                "--metrics_port needs prometheus_client: pip install 'petals-core[monitor]'"
            ) from None
        metrics = cls(CollectorRegistry())
        try:
            start_http_server(port, addr=host, registry=metrics.registry)
        except OSError as error:
            raise click.UsageError(
                f"cannot serve metrics on {host}:{port}: {error.strerror}; pick another --metrics_port"
            ) from None
        logger.info("Prometheus metrics at http://%s:%d/metrics", host, port)
        return metrics

    def request_started(self, rpc: str) -> None:
        self.requests.labels(rpc).inc()

    def request_failed(self, rpc: str, kind: str) -> None:
        self.errors.labels(rpc, kind).inc()

    def inference_step_done(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def compute_batch_started(self, now: float, submitted: Sequence[float]) -> None:
        for moment in submitted:
            self.queue_wait_seconds.observe(now - moment)
        self.batch_size.observe(len(submitted))


class _LiveStateCollector:
    """Gauges and counters read from the engine a server serves when Prometheus scrapes."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self.metrics.serving
        if engine is None:
            return
        yield GaugeMetricFamily(
            "petals_server_open_sessions", "Open inference sessions", value=len(engine.sessions)
        )
        yield GaugeMetricFamily("petals_server_blocks", "Blocks this server hosts", value=len(engine.blocks))
        yield from self._cache_metrics(engine.budget)
        yield CounterMetricFamily(
            "petals_server_tokens_computed",
            "Tokens computed, each counted once per block it went through (token-blocks)",
            value=engine.tokens_processed,
        )
        yield CounterMetricFamily(
            "petals_server_compute_busy_seconds",
            "Seconds the compute thread computed",
            value=engine.busy_seconds,
        )
        yield CounterMetricFamily(
            "petals_server_merged_batches",
            "Compute calls that ran several tasks",
            value=engine.scheduler.batches_merged,
        )
        stats = CounterMetricFamily("petals_server_events", "Inference and push events", labels=["event"])
        for event, count in dict(engine.events).items():  # a copy: the event loop may add keys meanwhile
            stats.add_metric([event], count)
        yield stats

    @staticmethod
    def _cache_metrics(budget: Any) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cache = GaugeMetricFamily("petals_server_kv_cache_bytes", "KV-cache budget by use", labels=["use"])
        cache.add_metric(["used"], budget.bytes_used)
        cache.add_metric(["free"], budget.bytes_left)
        cache.add_metric(["kept"], budget.bytes_kept)  # used by idle and kept sessions, yet available
        yield cache
        pages = GaugeMetricFamily(
            "petals_server_kv_cache_pages",
            "KV-cache pages: held by live sessions, lent by idle and kept ones, free",
            labels=["use"],
        )
        for use, count in budget.page_counts().items():
            pages.add_metric([use], count)
        yield pages
        yield CounterMetricFamily(
            "petals_server_sessions_preempted",
            "Live sessions whose pages went to an older session (their clients replay them)",
            value=budget.lender.preemptions,
        )
        yield CounterMetricFamily(
            "petals_server_sessions_reclaimed",
            "Idle or kept sessions whose pages went to another session",
            value=budget.lender.reclaimed,
        )
        yield GaugeMetricFamily(
            "petals_server_admission_waiting",
            "Sessions waiting for KV cache to open",
            value=budget.queue()["waiting"],
        )
        held = GaugeMetricFamily(
            "petals_server_kv_cache_held_bytes",
            "KV-cache bytes sessions hold (live, idle or kept), by cache kind",
            labels=["kind"],
        )
        for kind, nbytes in budget.bytes_by_kind().items():
            held.add_metric([kind], nbytes)
        yield held
