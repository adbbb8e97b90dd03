"""``petals health --initial_peers ... [MODEL]``: which blocks are covered, by whom, and is it healthy.

For every model of the swarm's ``_petals.models`` index (or the one given), a coverage bar over its
blocks, a table of its servers (with their KV cache: pages held by live sessions, lent by idle and kept
ones, free; and how many sessions they preempted) and a verdict. ``--json`` prints the original Petals health
monitor's ``/api/v1/state`` document instead; ``--watch`` refreshes every ``--update_period``.
Exits 1 when a model misses blocks (or none is announced), so scripts can check a swarm.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from petals.cli.options import PRIVATE_SWARM_OPTIONS, option, private_swarm_options, split_words
from petals.network.p2p import ALL_INTERFACES, LOOPBACK_MADDRS, NetworkOptions

if TYPE_CHECKING:
    from petals.network.client import ClientNetwork
    from petals.swarm_state import ModelReport, ServerRow, SwarmState

CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase display: the next frame replaces the last one
BAR = {"online": "█", "joining": "▒", "missing": "·"}
COLUMNS = (
    "peer",
    "blocks",
    "state",
    "throughput",
    "dtype",
    "quant",
    "adapters",
    "cache/block",
    "cache held",
    "pages live/kept/free",
    "preempted",
    "version",
    "public name",
    "pings to it",
)


@dataclass(frozen=True)
class SwarmQuery:
    """What ``petals health`` and ``petals monitor`` look at: MODEL (None: every model), through
    which peers, refreshed how often."""

    model: str | None
    network: NetworkOptions
    update_period: float


def swarm_query_options(command: Callable) -> Callable:
    """MODEL, ``--initial_peers``, ``--loopback``, ``--update_period`` and a private swarm's options,
    shared by ``petals health`` and ``petals monitor``, handed to ``command`` as one ``query: SwarmQuery``."""

    @functools.wraps(command)
    def with_query(
        model: str | None, initial_peers: tuple[str, ...], loopback: bool, update_period: float, **kwargs: Any
    ) -> Any:
        private_swarm = {name: kwargs.pop(name) for name in PRIVATE_SWARM_OPTIONS}
        network = client_network_options(initial_peers, loopback, **private_swarm)
        return command(query=SwarmQuery(model, network, update_period), **kwargs)

    peers_help = "Multiaddrs of swarm peers (repeat or space-separate)."
    model = click.argument("model", required=False)
    peers = option("--initial_peers", multiple=True, required=True, help=peers_help)
    loopback = option(
        "--loopback", is_flag=True, help="Listen on 127.0.0.1 only, no NAT traversal or relays."
    )
    period = option("--update_period", type=click.FloatRange(min=0.1), default=15, show_default=True)
    return model(peers(loopback(period(private_swarm_options(with_query)))))


def client_network_options(
    initial_peers: Sequence[str], loopback: bool, **private_swarm: str | None
) -> NetworkOptions:
    return NetworkOptions(
        **private_swarm,
        initial_peers=split_words(initial_peers),
        host_maddrs=LOOPBACK_MADDRS if loopback else ALL_INTERFACES,
        nat_port_map=not loopback,
        auto_nat=not loopback,
        use_relay=not loopback,
    )


def join_swarm(options: NetworkOptions) -> ClientNetwork:
    """A client peer in the swarm; a swarm it cannot reach is one line saying so, not a traceback."""
    from petals.membership import MembershipError
    from petals.network.client import ClientNetwork, SwarmUnreachableError

    try:
        return ClientNetwork(options)
    except (SwarmUnreachableError, MembershipError) as error:
        raise click.ClickException(str(error)) from None


@click.command("health")
@swarm_query_options
@option("--json", "as_json", is_flag=True, help="Print the /api/v1/state JSON document instead.")
@option("--watch", is_flag=True, help="Refresh in place every --update_period seconds (Ctrl-C stops).")
def health_command(query: SwarmQuery, as_json: bool, watch: bool) -> None:
    """Show block coverage, servers and health of MODEL (default: every model the swarm announces)."""
    from petals.swarm_state import UnknownModelError, fetch_swarm_state

    network = join_swarm(query.network)
    try:
        while True:
            started = time.monotonic()
            fetch = fetch_swarm_state(
                network.node,
                network.p2p,
                query.network.initial_peers,
                model=query.model,
                update_period=query.update_period,
            )
            try:
                state = network.run(fetch)
            except UnknownModelError as error:
                raise click.ClickException(str(error)) from None
            show(state, as_json=as_json, watch=watch)
            if not watch:
                sys.exit(0 if state.models and all(report.healthy for report in state.models) else 1)
            time.sleep(max(0.0, query.update_period - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    finally:
        network.close()


def show(state: SwarmState, *, as_json: bool, watch: bool) -> None:
    if as_json:
        # one document per line when watching (JSON Lines), indented once
        click.echo(json.dumps(state.to_json(), indent=None if watch else 2))
    elif watch:
        sys.stdout.write(CLEAR_SCREEN + render(state) + "\n")  # not click.echo: it drops escapes off a tty
    else:
        click.echo(render(state))
    sys.stdout.flush()


def render(state: SwarmState) -> str:
    """The whole report as text: per model a verdict, a coverage bar and the server table."""
    if not state.models:
        return "No model is announced in this swarm's _petals.models index yet.\n"
    updated = time.strftime("%H:%M:%S", time.localtime(state.last_updated))
    sections = [render_model(report) for report in state.models]
    bootstrap = ", ".join(state.bootstrap_states)
    return "\n".join([*sections, f"Bootstrap peers: {bootstrap}. Updated {updated}.\n"])


def render_model(report: ModelReport) -> str:
    online, joining = report.servers_per_block("online"), report.servers_per_block("joining")
    bar = "".join(
        BAR["online"] if on else BAR["joining"] if join else BAR["missing"]
        for on, join in zip(online, joining, strict=True)
    )
    lines = [
        f"{report.name} (dht_prefix {report.dht_prefix}, {report.num_blocks} blocks): {verdict(report)}",
        f"  blocks 0 {bar} {report.num_blocks}",
        f"  {BAR['online']} served by an ONLINE server  {BAR['joining']} only JOINING  {BAR['missing']} missing",
        "",
        *table([COLUMNS, *(server_cells(row) for row in report.rows)]),
    ]
    return "\n".join(lines) + "\n"


def verdict(report: ModelReport) -> str:
    missing = report.missing_ranges()
    if not missing:
        return "healthy"
    return "missing blocks " + ", ".join(f"{start}:{end}" for start, end in missing)


def server_cells(row: ServerRow) -> list[str]:
    info = row.span.server_info
    pings = [seconds for seconds in row.pings_to_me.values() if math.isfinite(seconds)]
    return [
        row.short_peer_id,
        f"{row.span.start}:{row.span.end}",
        row.state.upper(),
        f"{info.throughput:.1f}",
        info.torch_dtype or "-",
        (info.quant_type or "-")
        + (f" ({info.dequantized_from} dequantized)" if info.dequantized_from else "")
        + (f" ({info.packed_as} packed)" if info.packed_as else ""),
        ",".join(name.split("/")[-1] for name in info.adapters) or "-",
        _or_dash(row.cache_tokens_left_per_block),
        _or_dash(row.cache_memory),
        cache_pages(info.cache_pages),
        _or_dash(info.sessions_preempted),
        info.version or "-",
        info.public_name or "-",
        f"{len(pings)}, best {min(pings) * 1000:.1f} ms" if pings else "-",
    ]


def cache_pages(pages: dict[str, int] | None) -> str:
    """A server's cache pages by use: held by live sessions, lent by idle and kept ones (theirs until
    another session needs them), free."""
    if not pages:
        return "-"
    return "/".join(str(pages.get(use, 0)) for use in ("live", "kept", "free"))


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)
