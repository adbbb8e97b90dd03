"""Command-line option helpers shared by the ``petals`` commands, and the network options of
``petals serve`` and ``petals dht`` resolved into a ``NetworkOptions``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from petals.network.p2p import ALL_INTERFACES, LOOPBACK_MADDRS, PUBLIC_INITIAL_PEERS, NetworkOptions


def network_options_from_cli(
    *,
    initial_peers: Sequence[str],
    new_swarm: bool,
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    port: int | None,
    public_ip: str | None,
    identity_path: str | None,
    swarm_authority: str | None,
    membership: str | None,
    loopback: bool,
    no_nat_port_map: bool,
    no_auto_nat: bool,
    no_relay: bool,
    use_auto_relay: bool,
    default_initial_peers: Sequence[str] = PUBLIC_INITIAL_PEERS,
) -> NetworkOptions:
    """Resolve the CLI's network options (mutually exclusive pairs fail with a ``click.UsageError``)."""
    exclusive(("--initial_peers", bool(initial_peers)), ("--new_swarm", new_swarm))
    exclusive(("--port", port is not None), ("--host_maddrs", bool(host_maddrs)))
    exclusive(("--public_ip", public_ip is not None), ("--announce_maddrs", bool(announce_maddrs)))
    if public_ip is not None and not port:
        raise click.UsageError("--public_ip needs a fixed, non-zero --port to announce")
    if new_swarm:
        peers: Sequence[str] = ()
    else:
        peers = tuple(initial_peers) or tuple(default_initial_peers)
    if loopback and peers and any(peer in PUBLIC_INITIAL_PEERS for peer in peers):
        raise click.UsageError("--loopback cannot join the public swarm: pass --initial_peers or --new_swarm")
    if port is not None:
        hosts = (
            (f"/ip4/127.0.0.1/tcp/{port}",)
            if loopback
            else (f"/ip4/0.0.0.0/tcp/{port}", f"/ip6/::/tcp/{port}")
        )
    else:
        hosts = tuple(host_maddrs) or (LOOPBACK_MADDRS if loopback else ALL_INTERFACES)
    announce = (f"/ip4/{public_ip}/tcp/{port}",) if public_ip is not None else tuple(announce_maddrs) or None
    return NetworkOptions(
        initial_peers=peers,
        host_maddrs=hosts,
        announce_maddrs=announce,
        identity_path=identity_path,
        swarm_authority=swarm_authority,
        membership=membership,
        nat_port_map=not (loopback or no_nat_port_map),
        auto_nat=not (loopback or no_auto_nat),
        use_relay=not (loopback or no_relay),
        use_auto_relay=use_auto_relay and not loopback,
    )


def check_private_swarm(network: NetworkOptions, role: str | None = None) -> None:
    """Fail at once, before anything slow, if ``--swarm_authority``/``--membership`` cannot work."""
    if network.swarm_authority is None and network.membership is None:
        return
    from petals.membership import load_membership

    load_membership(network, role=role)


def exclusive(*flags: tuple[str, bool]) -> None:
    given = [name for name, is_given in flags if is_given]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)} are mutually exclusive: use only one of them")


def split_words(values: Sequence[str]) -> tuple[str, ...]:
    """Accept ``--opt a b`` style lists given as one space-separated string, repeated options, or YAML lists."""
    return tuple(word for value in values for word in str(value).split())


def network_cli_options(command: Callable) -> Callable:
    """The network options shared by ``petals serve`` and ``petals dht``, in both spellings."""
    options = [
        option(
            "--initial_peers", multiple=True, help="Multiaddrs of peers to join (repeat or space-separate)."
        ),
        option("--new_swarm", is_flag=True, help="Start a new private swarm (no initial peers)."),
        option(
            "--host_maddrs",
            multiple=True,
            help="Multiaddrs to listen on (default: all interfaces, random port).",
        ),
        option("--announce_maddrs", multiple=True, help="Multiaddrs to announce to other peers."),
        option(
            "--port",
            type=int,
            help="Listen on this TCP port (on all interfaces, or 127.0.0.1 with --loopback).",
        ),
        option("--public_ip", help="Announce this IP with --port (for servers behind port forwarding)."),
        *private_swarm_option_list(identity=True),
        option(
            "--loopback",
            is_flag=True,
            help="Listen on 127.0.0.1 only, with NAT port mapping, AutoNAT and relays off (tests, one-machine swarms).",
        ),
        option(
            "--no_nat_port_map", is_flag=True, help="Do not ask the LAN gateway to map a port (UPnP/NAT-PMP)."
        ),
        option("--no_auto_nat", is_flag=True, help="Disable the AutoNAT service."),
        option("--no_relay", is_flag=True, help="Disable libp2p circuit relays."),
        option("--use_auto_relay", is_flag=True, help="Look for relays automatically when behind NAT."),
    ]
    for decorate in reversed(options):
        command = decorate(command)
    return command


def private_swarm_option_list(identity: bool) -> list[Callable]:
    """``--identity_path`` (if ``identity``), ``--swarm_authority`` and ``--membership`` (``petals.membership``)."""
    identity_option = option(
        "--identity_path",
        type=click.Path(dir_okay=False),
        help="Private key file for a stable peer id (in a private swarm: the one --membership certifies).",
    )
    return [
        *([identity_option] if identity else []),
        option(
            "--swarm_authority",
            type=click.Path(dir_okay=False),
            help="A private swarm's authority.pub (`petals swarm init`): only its members take part.",
        ),
        option(
            "--membership",
            type=click.Path(dir_okay=False),
            help="This peer's membership certificate in the private swarm (`petals swarm admit`).",
        ),
    ]


PRIVATE_SWARM_OPTIONS = ("identity_path", "swarm_authority", "membership")  # also ClientConfig fields


def private_swarm_options(command: Callable) -> Callable:
    """``--identity_path``, ``--swarm_authority``, ``--membership`` for commands that join as clients."""
    for decorate in reversed(private_swarm_option_list(identity=True)):
        command = decorate(command)
    return command


def option(name: str, *more: str, **kwargs: Any) -> Callable:
    """A click option accepting both ``--snake_case`` and ``--kebab-case`` spellings."""
    names = [name, *more]
    if "_" in name:
        names.append(name.replace("_", "-"))
    return click.option(*names, **kwargs)


VERIFY_OPTION = click.option(
    "--verify",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="Fraction of inference steps recomputed on a second server of the same blocks; servers caught "
    "lying are banned.",
)


TOKENIZER_OPTION = click.option(
    "--tokenizer",
    default=None,
    metavar="PATH_OR_ID",
    help="Where the tokenizer is, when MODEL's folder has none (a folder or a Hugging Face repo id).",
)
