"""``petals dht --log_period`` sets how often it logs its status; ``--refresh_period`` is its old name."""

from click.testing import CliRunner

from petals.cli.run_dht import dht_command
from petals.testing.swarm import start_dht

STATUS_LINE = "peers connected"  # the status line the period paces (the default period is 30 s)


def test_log_period_paces_the_status_lines():
    with start_dht("--new_swarm", "--log_period", "0.2") as dht:
        dht.wait_for_log(STATUS_LINE, timeout=20)
        assert "--refresh_period is deprecated" not in dht.log


def test_refresh_period_still_sets_the_log_period_and_says_it_is_deprecated():
    with start_dht("--new_swarm", "--refresh_period", "0.2") as dht:
        dht.wait_for_log("--refresh_period is deprecated", timeout=20)
        dht.wait_for_log(STATUS_LINE, timeout=20)


def test_help_shows_log_period_only_and_both_names_together_are_refused():
    runner = CliRunner()
    shown = runner.invoke(dht_command, ["--help"])
    assert shown.exit_code == 0 and "--log_period" in shown.output and "--refresh_period" not in shown.output
    both = runner.invoke(
        dht_command, ["--new_swarm", "--loopback", "--log_period", "1", "--refresh_period", "2"]
    )
    assert both.exit_code == 2
    assert "--log_period and --refresh_period are mutually exclusive" in both.output
