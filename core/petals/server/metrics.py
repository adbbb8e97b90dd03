"""A server's own Prometheus metrics, served by ``petals serve --metrics_port N`` (off by default).

The handler and the compute queue call one function of this module per event (a request, a
failure, an inference step, a compute batch); while metrics are off, each call is one ``None``
check. What the server already keeps as live state (open sessions, the KV-cache budget, tokens
computed, merged batches, pushes) is read only when Prometheus scrapes, so it costs the hot path
nothing. prometheus_client (the ``monitor`` extra) is imported only when metrics are turned on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from petals.server.handler import TransformerConnectionHandler

logger = logging.getLogger(__name__)

STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WAIT_SECONDS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)

_recorder: _Recorder | None = None
_handler: TransformerConnectionHandler | None = None  # the serving span's, read at scrape time


def request_started(rpc: str) -> None:
    if _recorder is not None:
        _recorder.requests.labels(rpc).inc()


def request_failed(rpc: str, kind: str) -> None:
    """``kind`` is what the peer was told (``wire.ERROR_KINDS``): bad_request, cache_full, internal, ..."""
    if _recorder is not None:
        _recorder.errors.labels(rpc, kind).inc()


def inference_step_done(started: float) -> None:
    """An inference step that began at ``time.perf_counter() == started`` has its answer."""
    if _recorder is not None:
        _recorder.step_seconds.observe(time.perf_counter() - started)


def compute_batch_started(submitted: Sequence[float]) -> None:
    """The compute thread took a batch of tasks submitted at these ``time.perf_counter()`` times."""
    if _recorder is not None:
        now = time.perf_counter()
        for moment in submitted:
            _recorder.queue_wait_seconds.observe(now - moment)
        _recorder.batch_size.observe(len(submitted))


def serving(handler: TransformerConnectionHandler | None) -> None:
    """The handler whose sessions, cache budget and counters the gauges show (None while not serving)."""
    global _handler
    _handler = handler


def start_metrics_server(host: str, port: int | None) -> None:
    """Start recording and serve ``http://host:port/metrics`` from a background thread (no port: off)."""
    global _recorder
    if port is None:
        return
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise click.UsageError(
            "--metrics_port needs prometheus_client: pip install 'petals-core[monitor]'"
        ) from None
    registry = CollectorRegistry()
    recorder = _Recorder(registry)
    registry.register(_LiveStateCollector())
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise click.UsageError(
            f"cannot serve metrics on {host}:{port}: {error.strerror}; pick another --metrics_port"
        ) from None
    _recorder = recorder
    logger.info("Prometheus metrics at http://%s:%d/metrics", host, port)


class _Recorder:
    """The metrics updated per event."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

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


class _LiveStateCollector:
    """Gauges and counters read from the serving handler when Prometheus scrapes."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        handler = _handler
        if handler is None:
            return
        yield GaugeMetricFamily(
            "petals_server_open_sessions", "Open inference sessions", value=len(handler.sessions)
        )
        yield GaugeMetricFamily("petals_server_blocks", "Blocks this server hosts", value=len(handler.blocks))
        cache = GaugeMetricFamily("petals_server_kv_cache_bytes", "KV-cache budget by use", labels=["use"])
        cache.add_metric(["used"], handler.budget.bytes_used)
        cache.add_metric(["free"], handler.budget.bytes_left)
        yield cache
        yield CounterMetricFamily(
            "petals_server_tokens_computed",
            "Tokens run through blocks",
            value=handler.compute.tokens_processed,
        )
        yield CounterMetricFamily(
            "petals_server_compute_busy_seconds",
            "Seconds the compute thread computed",
            value=handler.compute.busy_seconds,
        )
        yield CounterMetricFamily(
            "petals_server_merged_batches",
            "Compute calls that ran several tasks",
            value=handler.compute.batches_merged,
        )
        stats = CounterMetricFamily("petals_server_events", "Inference and push events", labels=["event"])
        for event, count in dict(handler.stats).items():  # a copy: the event loop may add keys meanwhile
            stats.add_metric([event], count)
        yield stats
