"""``petals serve MODEL``: host blocks of a model in a swarm (also ``python -m petals.cli.run_server``).

Options take both spellings (``--num_blocks`` and ``--num-blocks``), can come from a YAML file
(``-c server.yml``, keys as option names) and from ``PETALS_<OPTION>`` environment variables
(``PETALS_NUM_BLOCKS=4``). Precedence: command line, environment, config file, defaults.

This module only parses options: the ones given are mapped onto ``petals.server.settings.ServerSettings``,
which holds every default (``--help`` shows them from there), and ``petals.server.planning``
decides the defaults that depend on the machine or the model (device, dtype, quantization, limits,
how many blocks fit, with the arithmetic logged) and measures the throughput.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import difflib
import gc
import json
import logging
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from petals.cli.errors import PetalsCliError, PetalsCommand, configure_logging
from petals.cli.model_files import check_local_path, not_found
from petals.cli.options import (
    check_private_swarm,
    exclusive,
    network_cli_options,
    network_options_from_cli,
    option,
    split_words,
)
from petals.cli.original_options import apply_original_options, original_petals_options, parse_size
from petals.network.p2p import NetworkOptions
from petals.patches import without_torch_distributed
from petals.server.settings import (
    DTYPE_CHOICES,
    QUANT_TYPE_CHOICES,
    THROUGHPUT_CHOICES,
    WEIGHTS_CHOICES,
    ServerSettings,
    SettingError,
    describe_default,
)

if TYPE_CHECKING:
    from petals.server.metrics import NoMetrics

logger = logging.getLogger(__name__)

# options named otherwise than their ServerSettings field (Petals' names)
SETTING_OF_OPTION = {"torch_dtype": "dtype"}
OPTION_OF_SETTING = {setting: name for name, setting in SETTING_OF_OPTION.items()}


class SettingOption(click.Option):
    """An option for a ``ServerSettings`` field: unset unless given, ``--help`` shows the field's default."""

    def get_help_extra(self, ctx: click.Context) -> dict[str, Any]:
        extra = dict(super().get_help_extra(ctx))
        default = describe_default(SETTING_OF_OPTION.get(self.name, self.name))
        if default is not None:
            extra["default"] = default
        return extra


def setting(name: str, *more: str, **kwargs: Any) -> Callable:
    return option(name, *more, cls=SettingOption, **kwargs)


def load_config_file(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """``-c FILE``: a YAML mapping of option names to values, used as defaults for this command."""
    if path is None:
        return None
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise click.BadParameter(f"cannot read {path}: {error}", ctx, param) from error
    if not isinstance(values, dict):
        raise click.BadParameter(f"{path} must hold a mapping of option names to values", ctx, param)
    values = {str(key).replace("-", "_"): value for key, value in values.items()}
    known = {option.name for option in ctx.command.params if option.name and option.name != param.name}
    for key in values:
        if key not in known:
            nearest = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {nearest[0]}?)" if nearest else ""
            raise click.BadParameter(f"{path}: unknown option {key!r}{hint}", ctx, param)
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


def parse_block_indices(ctx: click.Context, param: click.Parameter, value: str | None) -> range | None:
    if value is None:
        return None
    start, colon, end = value.partition(":")
    if not colon or not start.strip().isdigit() or not end.strip().isdigit() or int(start) >= int(end):
        raise click.BadParameter(f"expected START:END with START < END, e.g. 0:8; got {value!r}", ctx, param)
    return range(int(start), int(end))


def parse_throughput(ctx: click.Context, param: click.Parameter, value: str | None) -> str | float | None:
    if value is None or value in THROUGHPUT_CHOICES:
        return value
    try:
        number = float(value)
    except ValueError:
        raise click.BadParameter(
            f"expected {', '.join(THROUGHPUT_CHOICES)} or a number; got {value!r}", ctx, param
        ) from None
    if not number >= 0:
        raise click.BadParameter("throughput must be >= 0", ctx, param)
    return number


class WordsOption(click.Option):
    """``--option a b c`` as in Petals' argparse ``nargs="+"``: the words up to the next option, which
    ``ServeCommand`` spreads into a repeated option before click parses. (Repeating the option or
    quoting ``"a b c"`` works as well.)"""


class ServeCommand(PetalsCommand):
    """``petals serve``'s command: a ``PetalsCommand`` whose ``WordsOption`` take several words."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        names = {name for param in self.params if isinstance(param, WordsOption) for name in param.opts}
        return super().parse_args(ctx, spread_words(args, names))


def spread_words(args: Sequence[str], names: Container[str]) -> list[str]:
    """``--opt a b c`` → ``--opt a --opt b --opt c`` for the options in ``names`` (none after ``--``)."""
    spread: list[str] = []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        spread.append(arg)
        if arg == "--":
            return spread + rest
        name, equals, _ = arg.partition("=")
        if name in names:
            if not equals and rest:
                spread.append(rest.pop(0))  # its first value, taken as click takes it
            while rest and not rest[0].startswith("-"):
                spread += [name, rest.pop(0)]
    return spread


@click.command(
    "serve",
    cls=ServeCommand,
    context_settings={"auto_envvar_prefix": "PETALS", "help_option_names": ["-h", "--help"]},
)
@click.argument("model", required=False)
@click.option(
    "-c",
    "--config",
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=load_config_file,
    help="YAML file with option values.",
)
@setting("--public_name", help="Your name on the swarm's health monitor.")
@setting("--token", help="Hugging Face token for gated or private models.")
@setting(
    "--num_blocks", type=click.IntRange(min=1), help="Host this many blocks, where the swarm needs them most."
)
@setting(
    "--block_indices", callback=parse_block_indices, help="Host exactly blocks START:END (no rebalancing)."
)
@setting("--dht_prefix", "--prefix", help="DHT key prefix.")
@setting("--torch_dtype", type=click.Choice(DTYPE_CHOICES), help="Dtype to serve in.")
@setting("--quant_type", type=click.Choice(QUANT_TYPE_CHOICES), help="Weight quantization.")
@setting(
    "--weights",
    type=click.Choice(WEIGHTS_CHOICES),
    help="A quantized checkpoint's weights: kept in the bytes it stores them in (packed), or dequantized at "
    "load (faster per token, more memory; `petals plan` shows both).",
)
@option(
    "--tensor_parallel_devices",
    cls=WordsOption,
    multiple=True,
    help="Split each block over these devices (e.g. cuda:0 cuda:1).",
)
@option(
    "--adapters",
    cls=WordsOption,
    multiple=True,
    help="LoRA adapters to preload (local directories or repo ids, safetensors only); "
    "clients pick one by this name.",
)
@setting("--device", help="torch device.")
@setting(
    "--throughput",
    callback=parse_throughput,
    help="auto (measure once, cached), eval (measure again), dry_run (measure, print, exit) or a number.",
)
@setting("--max_batch_size", type=click.IntRange(min=1), help="Max tokens (batch × length) per request.")
@setting("--inference_max_length", type=click.IntRange(min=1), help="Max max_length of an inference session.")
@setting(
    "--attn_cache_tokens",
    type=click.IntRange(min=1),
    help="KV-cache budget: the bytes this many tokens of each hosted block's kind take, shared by all blocks.",
)
@setting("--request_timeout", type=float, help="Seconds per forward/backward.")
@setting("--session_timeout", type=float, help="Max seconds of one session.")
@setting("--step_timeout", type=float, help="Max seconds between session steps.")
@setting("--update_period", type=float, help="Seconds between DHT announcements.")
@setting("--expiration", type=float, help="DHT record lifetime.")
@setting(
    "--placement",
    type=click.Choice(["ours", "petals22"]),
    help="Placement policy: ours (water-filling with hysteresis) or petals22 (Petals 2.2's rules).",
)
@setting(
    "--balance_quality",
    type=float,
    help="Move when swarm throughput < this × what moving would give (0: never, >1: always).",
)
@setting("--mean_balance_check_period", type=float, help="Mean seconds between rebalancing checks.")
@setting("--stats_period", "--stats_report_interval", type=float, help="Seconds between status log lines.")
@setting(
    "--merge_window",
    type=click.FloatRange(min=0),
    help="Seconds a decode step may wait for the steps of other active sessions expected by then, "
    "to compute them as one batch (a lone session never waits; 0: no step waits).",
)
@setting(
    "--decode_threads",
    type=click.IntRange(min=1),
    help="Torch threads for steps of up to 64 tokens (decode steps); larger steps use all.",
)
@setting(
    "--backward_graph_budget",
    callback=parse_size,
    help="Memory that backward requests may keep activations in, all together, to run each block forward "
    "once (e.g. 512MiB, 4GiB; 0: recompute every block in the backward pass, as Petals does).",
)
@setting(
    "--cache_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Hugging Face cache for downloaded weights and home of the throughput cache.",
)
@original_petals_options
@option(
    "--metrics_port",
    type=click.IntRange(1, 65535),
    help="Serve Prometheus metrics on this port (default: off).",
)
@option("--metrics_host", default="127.0.0.1", show_default=True, help="Address to serve --metrics_port on.")
@network_cli_options
def serve_command(model: str | None, **options: Any) -> None:
    """Serve blocks of MODEL (a Hugging Face repo id or a local directory) to the swarm."""
    configure_logging()
    without_torch_distributed()  # before anything imports transformers' loading code
    gc.disable()  # until the server is ONLINE: see collect_startup_garbage
    try:
        model = apply_original_options(model, options)
        metrics_address = options.pop("metrics_host"), options.pop("metrics_port")
        settings = settings_from_cli(model, options)
        if settings is not None:
            from petals.server.metrics import ServerMetrics

            run_server(settings, ServerMetrics.serve(*metrics_address))
    finally:
        gc.enable()


def settings_from_argv(argv: Sequence[str]) -> ServerSettings:
    """The settings ``petals serve ARGV`` would serve with (for a server run in-process, as tests do)."""
    with serve_command.make_context("petals serve", list(argv)) as context:
        options = dict(context.params)
    options.pop("metrics_host"), options.pop("metrics_port")
    model = apply_original_options(options.pop("model"), options)
    settings = settings_from_cli(model, options)
    if settings is None:
        raise click.UsageError("--throughput dry_run serves nothing")
    return settings


def settings_from_cli(model: str, options: dict[str, Any]) -> ServerSettings | None:
    """The settings to serve with; ``None`` after ``--throughput dry_run`` (which prints the measurement)."""
    requested = requested_settings(model, options)
    settings = resolve(requested)
    if requested.throughput == "dry_run":
        click.echo(json.dumps(settings.throughput.__dict__))
        return None
    return settings


def requested_settings(model: str, options: dict[str, Any]) -> ServerSettings:
    """Check the option combinations, then map the options given onto ``ServerSettings``."""
    options["tensor_parallel_devices"] = split_words(options["tensor_parallel_devices"])
    options["adapters"] = split_words(options["adapters"])
    check_local_path(model)  # before the slow imports: a typo fails at once
    for name in options["adapters"]:
        check_local_path(name, "adapter")
    if options["tensor_parallel_devices"] and (
        options["quant_type"] not in (None, "none") or options["adapters"]
    ):
        raise click.UsageError(
            "--tensor_parallel_devices cannot be combined with --quant_type int8/nf4 or --adapters yet"
        )
    exclusive(
        ("--num_blocks", options["num_blocks"] is not None),
        ("--block_indices", options["block_indices"] is not None),
    )
    network = network_from_cli(options)
    check_private_swarm(network, role="server")
    given = {SETTING_OF_OPTION.get(name, name): value for name, value in options.items() if value is not None}
    return ServerSettings(model=model, network=network, **given)


def network_from_cli(options: dict[str, Any]) -> NetworkOptions:
    """Take the network options out of ``options``."""
    network = network_options_from_cli(
        initial_peers=split_words(options.pop("initial_peers")),
        host_maddrs=split_words(options.pop("host_maddrs")),
        announce_maddrs=split_words(options.pop("announce_maddrs")),
        **{name: options.pop(name) for name in NETWORK_SCALARS},
    )
    startup_timeout = options.pop("daemon_startup_timeout")
    if startup_timeout is None:
        return network
    return dataclasses.replace(network, startup_timeout=startup_timeout)


NETWORK_SCALARS = (
    "new_swarm",
    "port",
    "public_ip",
    "identity_path",
    "swarm_authority",
    "membership",
    "loopback",
    "no_nat_port_map",
    "no_auto_nat",
    "no_relay",
    "use_auto_relay",
)


def resolve(requested: ServerSettings) -> ServerSettings:
    """``resolve_settings``, its failures told as the option to change or as one error line."""
    from petals.plugins import PluginError
    from petals.server.planning import resolve_settings

    try:
        return resolve_settings(requested)
    except SettingError as error:
        option_name = OPTION_OF_SETTING.get(error.setting, error.setting)
        raise click.BadParameter(str(error), param_hint=f"--{option_name}") from error
    except (PluginError, OSError, ValueError) as error:  # the model's config, its adapters, the memory plan
        raise not_found(requested.model, error) or PetalsCliError(str(error)) from error


def run_server(settings: ServerSettings, metrics: NoMetrics) -> NoReturn:
    """Run until SIGINT/SIGTERM (see ``petals.cli.stopping``), then exit 0."""
    from petals.cli.stopping import StopSignals, exit_without_teardown
    from petals.server.server import Server

    server = Server(settings, metrics)

    async def main() -> None:
        StopSignals(server.stop).install()
        collecting = asyncio.create_task(collect_startup_garbage(server.online))
        try:
            await server.run()
        finally:
            collecting.cancel()

    asyncio.run(main())
    exit_without_teardown(0)


async def collect_startup_garbage(online: asyncio.Event) -> None:
    """Once the server is ONLINE, free the garbage of starting it and turn the cyclic GC back on.

    Starting creates hundreds of thousands of objects that live as long as the process (imported
    modules, mostly); with the GC on, Python traverses all of them in every full collection that
    importing triggers, to find little garbage. ``serve_command`` turns the GC off instead, and this
    one collection after going ONLINE frees that garbage (``benchmarks.server_start`` times a start).
    """
    await online.wait()
    resume_gc()


def resume_gc() -> None:
    """Collect once, turn the cyclic GC back on and give the freed memory back to the OS."""
    gc.collect()
    gc.enable()
    release_free_heap()


def release_free_heap() -> None:
    """Hand memory that is free but still held by malloc back to the OS (glibc only; else a no-op).

    glibc keeps freed heap pages for reuse; after the startup collection (and a throughput
    measurement's random block) they would stay in a server's resident memory
    (``benchmarks.server_memory`` measures what a serving server keeps).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    serve_command()
