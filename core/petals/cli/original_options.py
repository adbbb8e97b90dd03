"""The options of the original Petals ``run_server`` that ``petals serve`` takes besides its own.

Renamed ones are second names of ours (``--stats_report_interval`` is ``--stats_period``,
``--prefix`` is ``--dht_prefix``). Of the rest, those that mean something here are honoured:
``--converted_model_name_or_path``, ``--use_auth_token``, ``--daemon_startup_timeout``,
``--no_auto_relay``, ``--increase_file_limit``, ``--revision``, ``--max_disk_space``,
``--skip_reachability_check``. The others
(``NO_EFFECT``) are accepted so that existing command lines and config files keep working, and
each logs one line saying why it does nothing in this design.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import click

from petals.cli.options import exclusive, option
from petals.network.p2p import NetworkOptions

logger = logging.getLogger(__name__)

# option → (its type, why it has no effect here)
NO_EFFECT: dict[str, tuple[type, str]] = {
    "num_handlers": (int, "requests are served by one asyncio loop, not by handler processes"),
    "prefetch_batches": (int, "there is no hivemind Runtime: each request is queued as its own compute task"),
    "sender_threads": (int, "there is no hivemind Runtime: results go back from the asyncio loop"),
    "min_batch_size": (int, "requests are never held back to reach a minimum batch"),
    "max_chunk_size_bytes": (int, "long prefills are split into chunks of 512 tokens instead"),
    "compression": (str, "each request names its outputs' compression, and the server follows it"),
    "custom_module_path": (
        str,
        "model families are plugins (entry-point group 'petals', see plugins/README.md)",
    ),
    "mean_block_selection_delay": (float, "servers choose blocks from the DHT as soon as they have joined"),
    "max_alloc_timeout": (float, "a client's alloc_timeout is capped by --request_timeout instead"),
}

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """``50GB`` or ``100GiB`` or bytes (GB != GiB, as in Petals)."""
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if match is None or match.group(2).lower() not in SIZE_UNITS:
        raise click.BadParameter(
            f"expected a size such as 50GB, 100GiB or 1073741824; got {value!r}", ctx, param
        )
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def original_petals_options(command: Callable) -> Callable:
    """Add the original options that ``petals serve`` does not have under its own names."""
    options = [
        option("--converted_model_name_or_path", help="Same as MODEL (Petals' older spelling)."),
        option("--use_auth_token", is_flag=True, help="Use the token saved by `hf auth login` (as --token)."),
        option(
            "--daemon_startup_timeout",
            type=float,
            help=f"Seconds to wait for the p2p daemon to start (default: {NetworkOptions.startup_timeout:g}).",
        ),
        option("--no_auto_relay", is_flag=True, help="Do not look for relays (the default here)."),
        option(
            "--increase_file_limit",
            type=click.IntRange(min=0),
            is_flag=False,
            flag_value=4096,
            help="Raise the open-file limit to this many (4096 without a value; 0 keeps it).",
        ),
        option(
            "--skip_reachability_check",
            is_flag=True,
            help="Do not ask other peers whether they can connect to this server directly.",
        ),
        option("--revision", help="Model revision (branch, tag or commit) on the Hugging Face hub."),
        option(
            "--max_disk_space",
            callback=parse_size,
            help="Bound the Hugging Face cache (e.g. 50GB, 100GiB): before downloading, evict the least "
            "recently used files of other models.",
        ),
        *(
            option(f"--{name}", type=kind, help=f"Accepted for compatibility; no effect: {why}.")
            for name, (kind, why) in NO_EFFECT.items()
        ),
    ]
    for decorate in reversed(options):
        command = decorate(command)
    return command


def apply_original_options(model: str | None, options: dict[str, Any]) -> str:
    """Resolve the original options into ours (in place); returns the model name or path."""
    converted = options.pop("converted_model_name_or_path")
    exclusive(("MODEL", model is not None), ("--converted_model_name_or_path", converted is not None))
    model = model or converted
    if model is None:
        raise click.UsageError("missing MODEL: a Hugging Face repo id or a local model directory")
    exclusive(("--token", options["token"] is not None), ("--use_auth_token", options["use_auth_token"]))
    if options.pop("use_auth_token"):
        options["token"] = True
    exclusive(("--use_auto_relay", options["use_auto_relay"]), ("--no_auto_relay", options["no_auto_relay"]))
    options.pop("no_auto_relay")  # AutoRelay is off unless --use_auto_relay
    file_limit = options.pop("increase_file_limit")
    if file_limit:
        increase_file_limit(file_limit)
    for name, (_, why) in NO_EFFECT.items():
        if options.pop(name) is not None:
            logger.info("--%s has no effect here: %s", name, why)
    return model


def increase_file_limit(wanted: int) -> None:
    """Raise the soft RLIMIT_NOFILE towards ``wanted`` (never above the hard limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logger.info("Raised the open-file limit from %d to %d", soft, target)
