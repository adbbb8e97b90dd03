"""``petals dht``: a bootstrap peer (also ``python -m petals.cli.run_dht``).

Prints the multiaddrs others join with on stdout, one per line (ready for ``--initial_peers``),
then keeps the DHT running until SIGINT/SIGTERM and exits 0 (see ``petals.cli.stopping``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from petals.cli.errors import PetalsCommand, configure_logging
from petals.cli.options import exclusive, network_cli_options, network_options_from_cli, option, split_words
from petals.cli.run_server import resume_gc
from petals.cli.stopping import StopSignals, exit_without_teardown
from petals.network.p2p import leave_network

logger = logging.getLogger(__name__)


@click.command(
    "dht",
    cls=PetalsCommand,
    context_settings={"auto_envvar_prefix": "PETALS_DHT", "help_option_names": ["-h", "--help"]},
)
@option("--log_period", type=float, default=30, show_default=True, help="Seconds between status log lines.")
# the old name of --log_period (it never refreshed anything), still accepted for existing scripts
@option("--refresh_period", type=float, hidden=True)
@option(
    "--update_period",
    type=click.FloatRange(min=0.1),
    default=60,
    show_default=True,
    help="Private swarms: seconds between refreshes of the revocation list (fetch, reread --revocations, republish).",
)
@option(
    "--revocations",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Private swarms: the authority's revocations.json (`petals swarm revoke`), reread and published "
    "every --update_period (it may not exist yet).",
)
@network_cli_options
def dht_command(
    log_period: float,
    refresh_period: float | None,
    update_period: float,
    revocations: Path | None,
    **options: Any,
) -> None:
    """Run a DHT bootstrap peer for a (new or existing) swarm."""
    configure_logging()
    if refresh_period is not None:
        log_period = log_period_from_deprecated(log_period, refresh_period)
    if revocations is not None and options["swarm_authority"] is None:
        raise click.UsageError(
            "--revocations needs --swarm_authority: a revocation list belongs to a private swarm"
        )
    gc.disable()  # while importing and joining, as petals serve does (see collect_startup_garbage)
    try:
        run_dht(log_period, options, update_period=update_period, revocations=revocations)
    finally:
        gc.enable()


def log_period_from_deprecated(log_period: float, refresh_period: float) -> float:
    """``--refresh_period`` (deprecated) sets the log period, unless ``--log_period`` is given too."""
    context = click.get_current_context()
    exclusive(
        ("--log_period", context.get_parameter_source("log_period") != ParameterSource.DEFAULT),
        ("--refresh_period", True),
    )
    logger.warning("--refresh_period is deprecated: it sets the period of status log lines; use --log_period")
    return refresh_period


def run_dht(
    log_period: float, options: dict[str, Any], *, update_period: float = 60, revocations: Path | None = None
) -> NoReturn:
    from petals.dht import create_node
    from petals.membership import load_membership
    from petals.reachability import ReachabilityProtocol

    network = network_options_from_cli(
        initial_peers=split_words(options.pop("initial_peers")),
        host_maddrs=split_words(options.pop("host_maddrs")),
        announce_maddrs=split_words(options.pop("announce_maddrs")),
        default_initial_peers=(),
        **options,
    )
    membership = load_membership(network, certificate_required=False)  # a bootstrap peer needs no certificate

    async def main() -> None:
        stop = asyncio.Event()
        StopSignals(stop).install()
        p2p = await network.create_p2p()
        node = refreshing = None
        try:
            node = await create_node(p2p, network.initial_peers, membership)
            if membership is not None:
                refreshing = asyncio.create_task(
                    membership.keep_fresh(node, update_period, 2 * update_period, revocations)
                )
            await ReachabilityProtocol(p2p).add_p2p_handlers(p2p)  # servers ask us whether they are reachable
            for maddr in await p2p.get_visible_maddrs():
                click.echo(str(maddr))
            click.get_text_stream("stdout").flush()
            resume_gc()
            logger.info(
                "DHT bootstrap peer %s is running; pass the lines above to --initial_peers", p2p.peer_id
            )
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), log_period)
                except TimeoutError:
                    peers = await p2p.list_peers()
                    logger.info(
                        "%d peers connected, %d DHT records stored", len(peers), len(node.protocol.storage)
                    )
        finally:
            if refreshing is not None:
                refreshing.cancel()
            await leave_network(p2p, node)
            logger.info("DHT peer stopped")

    asyncio.run(main())
    exit_without_teardown(0)


if __name__ == "__main__":
    dht_command()
