"""``petals serve MODEL``: host blocks of a model in a swarm (also ``python -m petals.cli.run_server``).

Options take both spellings (``--num_blocks`` and ``--num-blocks``), can come from a YAML file
(``-c server.yml``, keys as option names) and from ``PETALS_<OPTION>`` environment variables
(``PETALS_NUM_BLOCKS=4``). Precedence: command line, environment, config file, defaults.

``--torch_dtype auto`` serves in the checkpoint's dtype, except that float32 checkpoints are served
in bfloat16 on GPUs (as Petals does) and stay float32 on CPU. ``--quant_type`` defaults to nf4 on
GPUs and none on CPU (and with ``--tensor_parallel_devices``, which does not combine with it yet).
Without ``--num_blocks`` and ``--block_indices`` the server hosts as many blocks as fit in memory
(``petals.convert.plan_num_blocks``, the arithmetic is logged).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import json
import logging
import os
from pathlib import Path
from typing import Any, NoReturn

import click

from petals.cli.errors import PetalsCliError, PetalsCommand, configure_logging, require_optional
from petals.cli.options import exclusive, network_cli_options, network_options_from_cli, option, split_words
from petals.cli.original_options import apply_original_options, original_petals_options

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANT_TYPES = ("none", "int8", "nf4")


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
    ctx.default_map = {**(ctx.default_map or {}), **{str(k).replace("-", "_"): v for k, v in values.items()}}
    return path


def parse_block_indices(ctx: click.Context, param: click.Parameter, value: str | None) -> range | None:
    if value is None:
        return None
    start, colon, end = value.partition(":")
    if not colon or not start.strip().isdigit() or not end.strip().isdigit() or int(start) >= int(end):
        raise click.BadParameter(f"expected START:END with START < END, e.g. 0:8; got {value!r}", ctx, param)
    return range(int(start), int(end))


def parse_throughput(ctx: click.Context, param: click.Parameter, value: str) -> str | float:
    if value in ("auto", "eval", "dry_run"):
        return value
    try:
        number = float(value)
    except ValueError:
        raise click.BadParameter(
            f"expected auto, eval, dry_run or a number; got {value!r}", ctx, param
        ) from None
    if not number >= 0:
        raise click.BadParameter("throughput must be >= 0", ctx, param)
    return number


class WordsOption(click.Option):
    """``--option a b c`` as in Petals' argparse ``nargs="+"``: the words up to the next option.

    (Repeating the option or quoting ``"a b c"`` works as well.)
    """

    def add_to_parser(self, parser, ctx: click.Context) -> None:
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            parsed = parser._long_opt[name]  # click has no public hook for variadic options
            parsed.process = _taking_following_words(parsed.process)


def _taking_following_words(process):
    def process_words(value, state) -> None:
        process(value, state)
        while state.rargs and not state.rargs[0].startswith("-"):
            process(state.rargs.pop(0), state)

    return process_words


@click.command(
    "serve",
    cls=PetalsCommand,
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
@option("--public_name", help="Your name on the swarm's health monitor.")
@option("--token", help="Hugging Face token for gated or private models.")
@option(
    "--num_blocks", type=click.IntRange(min=1), help="Host this many blocks, where the swarm needs them most."
)
@option(
    "--block_indices", callback=parse_block_indices, help="Host exactly blocks START:END (no rebalancing)."
)
@option(
    "--dht_prefix",
    "--prefix",
    help="DHT key prefix (default: derived from the model name by its family's rule).",
)
@option(
    "--torch_dtype", type=click.Choice(DTYPES), default="auto", show_default=True, help="Dtype to serve in."
)
@option(
    "--quant_type",
    type=click.Choice(QUANT_TYPES),
    help="Weight quantization (default: nf4 on GPUs, none on CPU or with --tensor_parallel_devices).",
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
@option("--device", help="torch device (default: cuda if available, else cpu).")
@option(
    "--throughput",
    default="auto",
    show_default=True,
    callback=parse_throughput,
    help="auto (measure once, cached), eval (measure again), dry_run (measure, print, exit) or a number.",
)
@option("--max_batch_size", type=click.IntRange(min=1), help="Max tokens (batch × length) per request.")
@option("--inference_max_length", type=click.IntRange(min=1), help="Max max_length of an inference session.")
@option("--attn_cache_tokens", type=click.IntRange(min=1), help="KV-cache budget in tokens per hosted block.")
@option("--request_timeout", type=float, default=180, show_default=True, help="Seconds per forward/backward.")
@option("--session_timeout", type=float, default=1800, show_default=True, help="Max seconds of one session.")
@option(
    "--step_timeout", type=float, default=300, show_default=True, help="Max seconds between session steps."
)
@option(
    "--update_period", type=float, default=60, show_default=True, help="Seconds between DHT announcements."
)
@option("--expiration", type=float, help="DHT record lifetime (default: max(2 × update_period, 3)).")
@option(
    "--balance_quality",
    type=float,
    default=0.75,
    show_default=True,
    help="Move when swarm throughput < this × what moving would give (0: never, >1: always).",
)
@option(
    "--mean_balance_check_period",
    type=float,
    default=60,
    show_default=True,
    help="Mean seconds between rebalancing checks.",
)
@option(
    "--stats_period",
    "--stats_report_interval",
    type=float,
    default=60,
    show_default=True,
    help="Seconds between status log lines.",
)
@option(
    "--cache_dir",
    type=click.Path(file_okay=False),
    help="Hugging Face cache for downloaded weights (default: HF's) and home of the throughput cache "
    "(default: $PETALS_CACHE or ~/.cache/petals).",
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
    gc.disable()  # until the server is ONLINE: see collect_startup_garbage
    try:
        model = apply_original_options(model, options)
        metrics_address = options.pop("metrics_host"), options.pop("metrics_port")
        settings = settings_from_cli(model, options)
        if settings is not None:
            from petals.server.metrics import start_metrics_server

            start_metrics_server(*metrics_address)
            run_server(settings)
    finally:
        gc.enable()


def settings_from_cli(model: str, options: dict[str, Any]):
    """Check the option combinations, then ``build_settings``."""
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
    network = network_options_from_cli(
        initial_peers=split_words(options.pop("initial_peers")),
        host_maddrs=split_words(options.pop("host_maddrs")),
        announce_maddrs=split_words(options.pop("announce_maddrs")),
        **{name: options.pop(name) for name in NETWORK_SCALARS},
    )
    network = dataclasses.replace(network, startup_timeout=options.pop("daemon_startup_timeout"))
    return build_settings(model, network, options)


NETWORK_SCALARS = (
    "new_swarm",
    "port",
    "public_ip",
    "identity_path",
    "loopback",
    "no_nat_port_map",
    "no_auto_nat",
    "no_relay",
    "use_auto_relay",
)


def build_settings(model: str, network, options: dict[str, Any]):
    """Resolve defaults that depend on the model and the machine; ``None`` after ``--throughput dry_run``."""
    import torch

    from petals.auto import AutoDistributedConfig
    from petals.convert import plan_num_blocks
    from petals.plugins import PluginError
    from petals.server.server import ServerSettings
    from petals.server.throughput import ThroughputInfo, get_server_throughput

    cache_dir = Path(options["cache_dir"]) if options["cache_dir"] else None
    try:
        config = AutoDistributedConfig.from_pretrained(
            model,
            dht_prefix=options["dht_prefix"],
            cache_dir=cache_dir,
            token=options["token"],
            revision=options["revision"],
        )
    except (PluginError, OSError, ValueError) as error:
        raise PetalsCliError(str(error)) from error
    try:
        tensor_parallel_devices = tuple(map(torch.device, options["tensor_parallel_devices"]))
    except RuntimeError as error:
        raise click.BadParameter(str(error), param_hint="--tensor_parallel_devices") from error
    default_device = tensor_parallel_devices[0] if tensor_parallel_devices else None
    device = torch.device(
        options["device"] or default_device or ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = resolve_dtype(options["torch_dtype"], config, device)
    quant_type = options["quant_type"] or (
        "nf4" if device.type == "cuda" and not tensor_parallel_devices else "none"
    )
    require_optional_packages(quant_type, tensor_parallel_devices, options["adapters"])
    adapter_weights = check_adapters(options["adapters"], cache_dir=cache_dir, token=options["token"])
    grouped_kv = config.num_key_value_groups > 1  # Petals' defaults are larger for GQA/multi-query models
    attn_cache_tokens = options["attn_cache_tokens"] or (16384 if grouped_kv else 4096)
    total_blocks = config.num_hidden_layers
    blocks = options["block_indices"]
    if blocks is not None and blocks.stop > total_blocks:
        raise click.UsageError(
            f"--block_indices {blocks.start}:{blocks.stop}: the model has {total_blocks} blocks"
        )
    if blocks is not None:
        num_blocks = len(blocks)
    elif options["num_blocks"] is not None:
        num_blocks = options["num_blocks"]
        if num_blocks > total_blocks:
            raise click.BadParameter(
                f"{num_blocks} blocks asked, but the model has {total_blocks}", param_hint="--num_blocks"
            )
    else:
        try:
            num_blocks, _ = plan_num_blocks(
                config,
                device,
                dtype,
                quant_type,
                attn_cache_tokens,
                adapter_files=adapter_weights,
                tensor_parallel_devices=tensor_parallel_devices,
            )
        except ValueError as error:
            raise PetalsCliError(str(error)) from error
    throughput = options["throughput"]
    if isinstance(throughput, float):
        throughput_info = ThroughputInfo(throughput)
    else:
        throughput_cache = Path(os.environ.get("PETALS_CACHE", Path.home() / ".cache" / "petals"))
        throughput_info = get_server_throughput(
            config,
            dtype,
            device,
            num_blocks,
            cache_dir or throughput_cache,
            force_eval=throughput != "auto",
            quant_type=quant_type,
            tensor_parallel_devices=tensor_parallel_devices,
        )
        if throughput == "dry_run":
            click.echo(json.dumps(throughput_info.__dict__))
            return None
    return ServerSettings(
        model=model,
        network=network,
        throughput=throughput_info,
        dtype=dtype,
        device=device,
        num_blocks=num_blocks,
        block_indices=blocks,
        dht_prefix=config.dht_prefix,
        token=options["token"],
        revision=options["revision"],
        cache_dir=cache_dir,
        max_disk_space=options["max_disk_space"],
        skip_reachability_check=options["skip_reachability_check"],
        max_batch_size=options["max_batch_size"] or (8192 if grouped_kv else 2048),
        inference_max_length=options["inference_max_length"] or (8192 if grouped_kv else 2048),
        attn_cache_tokens=attn_cache_tokens,
        request_timeout=options["request_timeout"],
        session_timeout=options["session_timeout"],
        step_timeout=options["step_timeout"],
        update_period=options["update_period"],
        expiration=options["expiration"],
        balance_quality=options["balance_quality"],
        mean_balance_check_period=options["mean_balance_check_period"],
        stats_period=options["stats_period"],
        public_name=options["public_name"],
        quant_type=quant_type,
        tensor_parallel_devices=tensor_parallel_devices,
        adapters=options["adapters"],
    )


def check_local_path(name: str, what: str = "model") -> None:
    """A name written as a path (``./x``, ``/x``, ``~/x``) must be a directory; others are repo ids."""
    if name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
        raise PetalsCliError(
            f"{what} {name}: no such directory; give an existing directory or a Hugging Face repo id (org/name)"
        )


def require_optional_packages(
    quant_type: str, tensor_parallel_devices: tuple, adapters: tuple[str, ...]
) -> None:
    """Fail before joining the swarm when an option's optional package is not installed."""
    for package, needed in (
        ("bitsandbytes", quant_type != "none"),
        ("tensor_parallel", bool(tensor_parallel_devices)),
        ("peft", bool(adapters)),
    ):
        if needed:
            require_optional(package)


def check_adapters(adapters: tuple[str, ...], **hub_kwargs) -> dict[str, Path]:
    """Each adapter's safetensors weights (downloaded if needed); a missing or pickle-only one stops the start."""
    from petals.convert import AdapterError, adapter_files

    try:
        return {name: adapter_files(name, name, **hub_kwargs)[1] for name in adapters}
    except (AdapterError, OSError) as error:
        raise PetalsCliError(str(error)) from error


def resolve_dtype(name: str, config, device):
    import torch

    if name != "auto":
        return getattr(torch, name)
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype == torch.float32:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return dtype


def run_server(settings) -> NoReturn:
    """Run until SIGINT/SIGTERM (see ``petals.cli.stopping``), then exit 0."""
    from petals.cli.stopping import StopSignals, exit_without_teardown
    from petals.server.server import Server

    server = Server(settings)

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

    Starting creates ~650k objects that live as long as the process (imported modules, mostly);
    with the GC on, Python traverses them in ~6 full collections while importing, ~0.6 s of a 3 s
    start, and finds ~10k objects (~7 MiB) of garbage. ``serve_command`` turns the GC off instead,
    and this one collection after going ONLINE (~0.3 s) frees that garbage.
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
    measurement's random block) that is ~7-10 MiB of a server's resident memory.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    serve_command()
