"""``petals monitor --initial_peers ...``: the swarm's health page, JSON API and Prometheus metrics.

Serves on 127.0.0.1 unless ``--host`` says otherwise (``--port 0`` picks a free port); the address
is printed once the first update of the swarm state is in. Needs the ``monitor`` extra
(``pip install petals-core[monitor]``).
"""

from __future__ import annotations

import socket

import click

from petals.cli.health import SwarmQuery, join_swarm, swarm_query_options
from petals.cli.options import option

FIRST_UPDATE_TIMEOUT = 60


@click.command("monitor")
@swarm_query_options
@option("--host", default="127.0.0.1", show_default=True, help="Address to serve the page on.")
@option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 picks a free port.")
def monitor_command(query: SwarmQuery, host: str, port: int) -> None:
    """Serve a web page and an API showing the swarm's block coverage and servers."""
    try:
        import uvicorn

        from petals.monitor import StateUpdater, create_app
    except ImportError as error:
        raise click.ClickException(
            f"{error}: petals monitor needs the monitor extra: pip install 'petals-core[monitor]'"
        ) from None
    listener = bind(host, port)
    network = join_swarm(query.network)
    updater = StateUpdater(network, query.network.initial_peers, query.model, query.update_period)
    try:
        updater.ready.wait(FIRST_UPDATE_TIMEOUT)  # after that, serve anyway: /api/v1/state says 503
        bound_host, bound_port = listener.getsockname()[:2]
        address = f"[{bound_host}]" if ":" in bound_host else bound_host
        click.echo(f"Monitor: http://{address}:{bound_port}/ (JSON at /api/v1/state, Prometheus at /metrics)")
        server = uvicorn.Server(uvicorn.Config(create_app(updater), log_level="warning"))
        server.run(sockets=[listener])
    finally:
        updater.stop()
        network.close()
        listener.close()


def bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket first, so that a busy port fails before joining the swarm."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen()  # requests that come before uvicorn runs wait in the backlog
    except OSError as error:
        listener.close()
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {error.strerror}; pick another --port"
        ) from None
    return listener


if __name__ == "__main__":
    monitor_command()
