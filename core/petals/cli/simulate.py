"""``petals simulate``: run the product's placement, rebalancing and routing policies over a simulated
swarm (``petals.simulate``) and print the metrics; optionally write them as JSON and a plot."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import click

from petals.cli.errors import PetalsCliError, PetalsCommand


@click.command("simulate", cls=PetalsCommand)
@click.option("--servers", type=click.IntRange(min=1), help="Servers in the swarm (default 1000).")
@click.option("--blocks", type=click.IntRange(min=1), help="Transformer blocks of the model (default 80).")
@click.option(
    "--model",
    help="Plan the blocks and each GPU kind's max_blocks and cache_sessions for this model (a folder or hub "
    "id; its config.json only) from the kind's memory_gib, as `petals serve` and `petals plan` do.",
)
@click.option("--hours", type=click.FloatRange(min=0, min_open=True), help="Simulated hours (default 24).")
@click.option("--seed", type=int, help="Seed of the trace and the policies (default 0).")
@click.option(
    "--churn", type=click.FloatRange(min=0), help="Server departures per server-hour (default 0.5)."
)
@click.option(
    "--clients", type=click.IntRange(min=0), help="Clients running inference sessions (default 200)."
)
@click.option(
    "--policy",
    type=click.Choice(["ours", "petals22", "both"]),
    default="both",
    show_default=True,
    help="Which policies to simulate on the same trace.",
)
@click.option(
    "--scenario",
    "scenario_path",
    type=click.Path(exists=True, dir_okay=False),
    help="YAML file of scenario keys (GPU mix, regions, round trips, ...); the options above override it.",
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), help="Also write the metrics here (JSON)."
)
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG of the metrics over time."
)
def simulate_command(
    servers: int | None,
    blocks: int | None,
    model: str | None,
    hours: float | None,
    seed: int | None,
    churn: float | None,
    clients: int | None,
    policy: str,
    scenario_path: str | None,
    json_path: str | None,
    plot_path: str | None,
) -> None:
    """Simulate a swarm and compare placement and routing policies (no networking)."""
    from petals.simulate import (
        POLICIES,
        Scenario,
        load_scenario,
        run_policy,
        summary_lines,
        with_comparison,
        with_model_capacities,
    )

    if model is not None and blocks is not None:
        raise click.UsageError("--model gives the number of blocks (its config's): leave out --blocks")
    overrides = dict(
        servers=servers, blocks=blocks, hours=hours, seed=seed, churn=churn, clients=clients, model=model
    )
    try:
        scenario = (
            load_scenario(scenario_path, **overrides) if scenario_path else Scenario().replace(**overrides)
        )
        scenario = with_model_capacities(scenario)  # once here, not in each policy's process
    except (ValueError, TypeError) as error:
        raise PetalsCliError(str(error)) from None
    if plot_path and importlib.util.find_spec("matplotlib") is None:  # before the simulation, not after it
        raise PetalsCliError(
            "--plot needs matplotlib: pip install 'petals-core[simulate]' (or leave out --plot)"
        )
    policies = POLICIES if policy == "both" else (policy,)
    with ProcessPoolExecutor(len(policies)) as pool:
        results = dict(zip(policies, pool.map(run_policy, [scenario] * len(policies), policies), strict=True))
    report = with_comparison(scenario, results)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    for line in summary_lines(report):
        click.echo(line)
    if plot_path:
        from petals.simulate.plot import plot_report

        plot_report(report, plot_path)
        click.echo(f"plot: {plot_path}")
