"""The ``petals`` command line: ``petals plugins``, ``petals serve``, ``petals dht``, ...

Each command lives in its own module of this package and is added to the ``main`` group below.
"""

from __future__ import annotations

import click

from petals import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="petals-core")
def main() -> None:
    """Run large language models collaboratively."""


@main.command("plugins")
@click.option("--hooks", is_flag=True, help="Also list the hooks each plugin implements.")
def plugins_command(hooks: bool) -> None:
    """List installed model-family plugins, their versions and model types."""
    from petals.plugins import get_plugin_manager

    manager = get_plugin_manager()
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


from petals.cli.run_dht import dht_command  # noqa: E402
from petals.cli.run_server import serve_command  # noqa: E402

main.add_command(serve_command)
main.add_command(dht_command)
from petals.cli.demo import demo_command  # noqa: E402
from petals.cli.generate import generate_command  # noqa: E402

main.add_command(demo_command)
main.add_command(generate_command)
