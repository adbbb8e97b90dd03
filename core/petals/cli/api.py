"""``petals api MODEL --initial_peers ...``: the OpenAI API, the Petals chat API and a chat page."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from petals.cli.errors import PetalsCommand
from petals.cli.options import TOKENIZER_OPTION, VERIFY_OPTION, private_swarm_options
from petals.patches import without_torch_distributed

READY_MESSAGE = "petals api: serving"


@click.command("api", cls=PetalsCommand)  # known failures (a bad --membership) in one line
@click.argument("model")
@click.option(
    "--initial_peers", "--initial-peers", multiple=True, required=True, help="Multiaddr of a swarm peer."
)
@click.option(
    "--dht_prefix", "--dht-prefix", default=None, help="DHT prefix of the model (default: derived)."
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, help="Port to listen on (0: any free port).")
@click.option(
    "--loopback", is_flag=True, help="Join the swarm on 127.0.0.1 only, no NAT traversal or relays."
)
@click.option(
    "--api_key",
    "--api-key",
    envvar="PETALS_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' (or set PETALS_API_KEY); a WebSocket may send it as "
    "api_key in its first message.",
)
@click.option(
    "--allow_origin",
    "--allow-origin",
    "allow_origins",
    multiple=True,
    metavar="ORIGIN",
    help="Also serve pages from this origin, e.g. https://chat.example.org (repeatable; default: the "
    "API's own only).",
)
@click.option(
    "--allow_host",
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    help="Also answer requests naming this Host, e.g. behind a proxy (repeatable; IP addresses, "
    "localhost and --host always are).",
)
@click.option(
    "--model_id",
    "--model-id",
    default=None,
    help="Model name clients use (default: MODEL; a local folder's name).",
)
@click.option(
    "--max_tokens", "--max-tokens", default=1024, show_default=True, help="Most tokens per request."
)
@click.option(
    "--max_request_bytes",
    "--max-request-bytes",
    default=1 << 20,
    show_default=True,
    help="Largest request body.",
)
@click.option(
    "--session_timeout",
    "--session-timeout",
    default=300.0,
    show_default=True,
    help="Seconds a WebSocket session may stay idle.",
)
@TOKENIZER_OPTION
@VERIFY_OPTION
@click.option(
    "--prompts",
    "prompts",
    multiple=True,
    metavar="NAME=FILE",
    callback=lambda ctx, param, values: [parse_named_prompts(value) for value in values],
    help="Also serve MODEL with these trained prompts (from `petals tune`) as the model NAME (repeatable).",
)
@private_swarm_options
def api_command(
    model: str,
    initial_peers: tuple[str, ...],
    dht_prefix: str | None,
    host: str,
    port: int,
    loopback: bool,
    api_key: str | None,
    allow_origins: tuple[str, ...],
    allow_hosts: tuple[str, ...],
    model_id: str | None,
    max_tokens: int,
    max_request_bytes: int,
    session_timeout: float,
    tokenizer: str | None,
    verify: float,
    prompts: list[tuple[str, str]],
    **private_swarm: str | None,
) -> None:
    """Serve MODEL's swarm over HTTP: OpenAI API at /v1, Petals chat API at /api, a chat page at /."""
    without_torch_distributed()  # before anything imports transformers' loading code
    from petals.api.guard import Guard
    from petals.api.service import Limits

    limits = Limits(
        max_new_tokens=max_tokens, max_request_bytes=max_request_bytes, session_timeout=session_timeout
    )
    run_api(
        model,
        list(initial_peers),
        host=host,
        port=port,
        loopback=loopback,
        guard=Guard(api_key, host, allow_hosts, allow_origins),
        model_id=model_id,
        limits=limits,
        dht_prefix=dht_prefix,
        private_swarm=private_swarm,
        verify=verify,
        prompts=prompts,
        tokenizer=tokenizer,
    )


def parse_named_prompts(value: str) -> tuple[str, str]:
    name, _, path = value.partition("=")
    if not name or not path:
        raise click.BadParameter(f"expected NAME=FILE, got {value!r}", param_hint="--prompts")
    if not Path(path).is_file():
        raise click.BadParameter(f"no prompts file at {path}", param_hint="--prompts")
    return name, path


def run_api(
    model: str,
    initial_peers: list[str],
    *,
    host: str,
    port: int,
    loopback: bool,
    limits,
    guard=None,
    model_id: str | None = None,
    dht_prefix: str | None = None,
    on_ready: Callable[[str, str], None] | None = None,
    private_swarm: dict[str, str | None] | None = None,
    verify: float = 0.0,
    prompts: list[tuple[str, str]] = (),
    tokenizer: str | None = None,
) -> None:
    """Load the client model, bind, print where it serves (and ``on_ready(url)``), serve until a signal;
    ``guard`` (``petals.api.guard.Guard``; default: no key, the API's own pages) says who may use it."""
    try:
        from petals.api.app import bind, create_app, serve
        from petals.api.guard import Guard
        from petals.api.service import ModelService
    except ImportError as error:
        raise click.ClickException(
            f"petals api needs its extra ({error.name} is missing): pip install 'petals-core[api]'"
        ) from error
    from petals import AutoDistributedModelForCausalLM
    from petals.cli.model_files import check_local_path, finding, load_tokenizer

    check_local_path(model)
    sock = bind(host, port)  # before loading: a taken port fails at once
    try:
        loaded_tokenizer = load_tokenizer(model, tokenizer)
        client = dict(
            initial_peers=initial_peers,
            dht_prefix=dht_prefix,
            verify=verify,
            loopback=loopback,
            **(private_swarm or {}),
        )
        with finding(model):
            distributed = AutoDistributedModelForCausalLM.from_pretrained(model, **client)
    except BaseException:
        sock.close()
        raise
    try:
        model_id = model_id or (Path(model).name if Path(model).is_dir() else model)
        service = ModelService(distributed, loaded_tokenizer, model_id, limits, aliases=[model])
        for name, path in prompts:
            service.add_variant(distributed.with_prompts(path), name)
        address = sock.getsockname()
        url = f"http://{host if ':' not in host else f'[{host}]'}:{address[1]}"
        click.echo(f"{READY_MESSAGE} {model_id} at {url} (OpenAI base URL {url}/v1, chat page {url}/)")
        if on_ready is not None:
            on_ready(url, model_id)
        serve(create_app(service, guard or Guard(host=host)), sock, service)
    finally:
        distributed.close()
        sock.close()
