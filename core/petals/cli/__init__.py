"""The ``petals`` command line: ``petals plugins``, ``petals serve``, ``petals dht``, ...

Each command lives in its own module of this package and is imported only when it runs (or when
``--help`` lists it): ``petals dht`` never imports transformers, and ``python -m
petals.cli.run_server`` does not find its own module imported already.
"""

from __future__ import annotations

import importlib

import click

from petals import __version__

# command name → "module:attribute" of its click command
LAZY_COMMANDS = {
    "serve": "petals.cli.run_server:serve_command",
    "dht": "petals.cli.run_dht:dht_command",
    "demo": "petals.cli.demo:demo_command",
    "generate": "petals.cli.generate:generate_command",
    "api": "petals.cli.api:api_command",
    "health": "petals.cli.health:health_command",
    "monitor": "petals.cli.monitor:monitor_command",
    "chat": "petals.cli.chat:chat_command",
    "swarm": "petals.cli.swarm:swarm_command",
    "simulate": "petals.cli.simulate:simulate_command",
    "plan": "petals.cli.plan:plan_command",
    "tune": "petals.cli.tune:tune_command",
}


class LazyGroup(click.Group):
    """A click group whose commands in ``LAZY_COMMANDS`` are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in LAZY_COMMANDS:
            module, _, attribute = LAZY_COMMANDS[name].partition(":")
            return getattr(importlib.import_module(module), attribute)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="petals-core")
def main() -> None:
    """Run large language models collaboratively."""


@main.command("plugins")
@click.option("--hooks", is_flag=True, help="Also list the hooks each plugin implements.")
@click.option(
    "--families",
    "list_families",
    is_flag=True,
    help="List transformers' causal-LM model types instead: served by which plugin, with which cache kinds, "
    "or why not.",
)
def plugins_command(hooks: bool, list_families: bool) -> None:
    """List installed model-family plugins, their versions and model types."""
    from petals.plugins import get_plugin_manager

    manager = get_plugin_manager()
    if list_families:
        from petals.families_report import family_rows, format_rows

        click.echo(format_rows(family_rows(manager)))
        return
    families = manager.model_families()
    names = manager.plugin_names()
    if not names:
        click.echo("No model-family plugins installed. Install one, e.g. `pip install petals-<family>`.")
    for name in names:
        distribution = manager.distributions.get(name)
        version = f"{distribution.name} {distribution.version}" if distribution else "registered in-process"
        model_types = ", ".join(sorted(f.model_type for f in families.values() if f.plugin == name)) or "-"
        click.echo(f"{name}\t{version}\tmodel types: {model_types}")
        if hooks:
            click.echo(f"\thooks: {', '.join(manager.hooks_of(name))}")
    for failure in manager.failures:
        click.echo(f"{failure.name}\tFAILED TO LOAD: {failure.error}", err=True)
