"""Known failures of ``petals`` commands end in one line: ``Error: what went wrong; what to do``.

Every command is a ``PetalsCommand``. It takes ``--log_level`` (also ``PETALS_LOG_LEVEL``), and
when its body raises, it looks the exception (and the exceptions it was raised from) up in
``KNOWN_FAILURES``. A known failure becomes a ``click.ClickException``: click prints the line and
exits 1 (usage errors stay ``click.UsageError``: exit 2). The traceback is printed only at
``DEBUG``. Anything not in the table is a bug and keeps its traceback.

The table matches by exception type and, for errors that only a message tells apart (hivemind's
``P2PDaemonError`` is one class for every way the p2p daemon fails), by a substring.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import click

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class PetalsCliError(click.ClickException):
    """A failure the command understood; raised where the cause is known, shown as one line."""


@dataclass(frozen=True)
class KnownFailure:
    """Exceptions named ``type_name`` (any class in their MRO) whose message holds ``text``."""

    type_name: str
    explain: Callable[[BaseException], str]
    text: str = ""

    def matches(self, error: BaseException) -> bool:
        names = {cls.__name__ for cls in type(error).__mro__}
        return self.type_name in names and self.text in str(error)


# optional packages → (the petals-core extra that installs them, the option that needs them)
OPTIONAL_PACKAGES = {
    "bitsandbytes": ("quantization", "--quant_type int8/nf4"),
    "peft": ("adapters", "--adapters"),
    "tensor_parallel": ("tensor-parallel", "--tensor_parallel_devices"),
}


def missing_package_message(package: str) -> str | None:
    if package not in OPTIONAL_PACKAGES:
        return None
    extra, option = OPTIONAL_PACKAGES[package]
    return f"{option} needs the optional package {package}: pip install 'petals-core[{extra}]'"


def _missing_package(error: BaseException) -> str:
    package = (getattr(error, "name", None) or "").split(".")[0]
    return missing_package_message(package) or f"{error}: install it, then run the command again"


KNOWN_FAILURES: tuple[KnownFailure, ...] = (
    KnownFailure(
        "P2PDaemonError",
        lambda error: (
            f"the port is in use ({_daemon_detail(error)}): choose another --port "
            "(or --port 0 for a free one) or stop the process that holds it"
        ),
        text="address already in use",
    ),
    KnownFailure(
        "P2PDaemonError",
        lambda error: (
            "cannot reach any of the --initial_peers: check that they are running and that these "
            "multiaddrs are the ones `petals dht` printed (including /p2p/<peer id>); use --new_swarm to start "
            "a swarm of your own"
        ),
        text="failed to connect to bootstrap peers",
    ),
    KnownFailure("P2PDaemonError", lambda error: f"the p2p daemon failed: {_daemon_detail(error)}"),
    KnownFailure(
        "PortInUseError",
        lambda error: (
            f"the port is in use ({error.strerror}): choose another --port (or --port 0 for a free one) "
            "or stop the process that holds it"
        ),
    ),
    KnownFailure("IdentityInUseError", str),
    KnownFailure("IdentityFileError", str),
    KnownFailure("SwarmUnreachableError", str),
    KnownFailure("MissingBlocksError", str),
    KnownFailure("ServerFailure", str),  # every server of some blocks fails with the same [internal] error
    KnownFailure("MembershipError", str),
    KnownFailure("ModuleNotFoundError", _missing_package),
    KnownFailure("ImportError", str),  # ours say which extra to install
    KnownFailure("PluginError", str),
    KnownFailure("CheckpointError", str),
    KnownFailure("ConfigError", str),  # petals.auto
    KnownFailure("ModelNotFoundError", str),  # petals.cli.model_files
    KnownFailure("MissingTokenizerError", str),
    KnownFailure("PromptsFileError", str),
    KnownFailure("AdapterError", str),
    KnownFailure("DiskSpaceError", str),
    KnownFailure(
        "HFValidationError",
        lambda error: (
            "the model is neither an existing local directory nor a Hugging Face repo id "
            "(org/name): check the path"
        ),
    ),
    KnownFailure("RepositoryNotFoundError", lambda error: f"no such model on the Hugging Face hub: {error}"),
    KnownFailure("GatedRepoError", lambda error: f"this model is gated: pass --token ({error})"),
    KnownFailure(
        "OfflineModeIsEnabled",
        lambda error: f"{error}; unset HF_HUB_OFFLINE or put the model in the Hugging Face cache",
    ),
)


def _daemon_detail(error: BaseException) -> str:
    """The daemon's own last line, without hivemind's prefix and the Go log timestamp."""
    detail = str(error).removeprefix("Daemon failed to start: ")
    words = detail.split(" ", 2)
    if len(words) == 3 and words[0].count("/") == 2 and words[1].count(":") == 2:
        return words[2]
    return detail


def _causes(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def explain(error: BaseException) -> str | None:
    """The one-line message for a known failure (found anywhere in its cause chain), else None."""
    for cause in _causes(error):
        for failure in KNOWN_FAILURES:
            if failure.matches(cause):
                return failure.explain(cause)
    return None


def log_level() -> str:
    return os.environ.get("PETALS_LOG_LEVEL", "INFO").upper()


def configure_logging() -> None:
    logging.basicConfig(
        level=log_level(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        os.environ["PETALS_LOG_LEVEL"] = value.upper()  # child processes (petals demo's servers) follow


LOG_LEVEL_OPTION = click.Option(
    ["--log_level", "--log-level"],
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    expose_value=False,
    is_eager=True,
    callback=_set_log_level,
    help="Log level (also PETALS_LOG_LEVEL); DEBUG shows tracebacks of known failures.",
)


class PetalsCommand(click.Command):
    """A command with ``--log_level`` whose known failures end in one ``Error:`` line."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(LOG_LEVEL_OPTION)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.UsageError, click.exceptions.Exit, click.Abort):
            raise
        except Exception as error:
            failure = error if isinstance(error, click.ClickException) else _known_failure(error)
            if failure is None:
                raise  # not a known failure: a bug, whose traceback is worth seeing
            if log_level() == "DEBUG":
                traceback.print_exception(error)
            if failure is error:
                raise
            raise failure from error


def _known_failure(error: Exception) -> PetalsCliError | None:
    message = explain(error)
    return PetalsCliError(message) if message is not None else None
