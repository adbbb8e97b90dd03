"""Seeing the swarm: ``petals health``, ``petals monitor`` and a server's ``--metrics_port``.

One real swarm for the module: a bootstrap peer, a tiny Llama served in two halves (healthy), and a
tiny BLOOM of which only blocks 0:2 are served (missing 2:4). A ``petals monitor`` and a
``petals health --watch`` follow it while a second BLOOM server joins (BLOOM becomes healthy) and
leaves again (back to missing 2:4).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import petals
from conftest import launch_chromium, petals_health
from petals.cli.health import CLEAR_SCREEN
from petals.data_structures import ServerInfo
from petals.testing.swarm import InProcessDht, InProcessServer, SwarmProcess, start_monitor, start_server
from petals.testing.wire_client import WireClient

pytestmark = pytest.mark.slow

UPDATE_PERIOD = 2.0
LLAMA, BLOOM = "tiny-llama-hf", "tiny-bloom-petals"  # the dht_prefixes of the tiny models' folders
SCREENSHOT = Path(__file__).parents[1] / "docs" / "monitor.png"

_SERVER_INFO = {
    "type": "object",
    "required": ["state", "throughput", "start_block", "end_block", "version", "adapters", "torch_dtype"],
    "properties": {
        "state": {"enum": ["offline", "joining", "online"]},
        "throughput": {"type": "number"},
        "start_block": {"type": ["integer", "null"]},
        "end_block": {"type": ["integer", "null"]},
        "public_name": {"type": ["string", "null"]},
        "version": {"type": ["string", "null"]},
        "network_rps": {"type": ["number", "null"]},
        "forward_rps": {"type": ["number", "null"]},
        "inference_rps": {"type": ["number", "null"]},
        "adapters": {"type": "array", "items": {"type": "string"}},
        "torch_dtype": {"type": ["string", "null"]},
        "quant_type": {"type": ["string", "null"]},
        "using_relay": {"type": ["boolean", "null"]},
        "cache_tokens_left": {"type": ["integer", "null"]},
        "next_pings": {"type": ["object", "null"], "additionalProperties": {"type": ["number", "null"]}},
        "cache_bytes": {"type": ["integer", "null"], "minimum": 0},
        "cache_bytes_held": {
            "type": ["object", "null"],
            "additionalProperties": {"type": "integer", "minimum": 0},
        },
    },
}
_SERVER_ROW = {
    "type": "object",
    "required": ["short_peer_id", "peer_id", "show_public_name", "state", "span", "adapters", "pings_to_me"],
    "properties": {
        "short_peer_id": {"type": "string", "pattern": r"^\.\.\..{6}$"},
        "peer_id": {"type": "string"},
        "show_public_name": {"type": "boolean"},
        "state": {"enum": ["offline", "joining", "online", "unreachable"]},
        "span": {
            "type": "object",
            "required": ["peer_id", "start", "end", "server_info"],
            "properties": {
                "peer_id": {"type": "string"},
                "start": {"type": "integer", "minimum": 0},
                "end": {"type": "integer", "minimum": 1},
                "server_info": _SERVER_INFO,
            },
        },
        "cache_tokens_left_per_block": {"type": "integer", "minimum": 0},
        "cache_memory": {"type": "string", "pattern": r"^\d+\.\d of \d+\.\d MiB"},
        "adapters": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "short_name"],
                "properties": {"name": {"type": "string"}, "short_name": {"type": "string"}},
            },
        },
        "pings_to_me": {"type": "object", "additionalProperties": {"type": ["number", "null"]}},
    },
}
# the original health monitor's /api/v1/state, as its templates and users' tools read it
STATE_SCHEMA = {
    "type": "object",
    "required": ["model_reports", "last_updated", "update_period", "bootstrap_states", "reachability_issues"],
    "properties": {
        "bootstrap_states": {"type": "array", "items": {"enum": ["online", "unreachable"]}},
        "top_contributors": {"type": "object", "additionalProperties": {"type": "integer"}},
        "model_reports": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "name",
                    "short_name",
                    "dht_prefix",
                    "num_blocks",
                    "state",
                    "server_rows",
                    "repository",
                ],
                "properties": {
                    "name": {"type": "string"},
                    "short_name": {"type": "string"},
                    "dht_prefix": {"type": "string"},
                    "num_blocks": {"type": "integer", "minimum": 1},
                    "repository": {"type": ["string", "null"]},
                    "state": {"enum": ["healthy", "broken"]},
                    "server_rows": {"type": "array", "items": _SERVER_ROW},
                },
            },
        },
        "reachability_issues": {
            "type": "array",
            "items": {"type": "object", "required": ["peer_id", "err"]},
        },
        "last_updated": {"type": "number"},
        "update_period": {"type": "number"},
        "update_duration": {"type": "number"},
    },
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    llama, bloom = tiny_model_path("llama"), tiny_model_path("bloom")
    metrics_port = free_port()
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        peers = dht.initial_peers
        common = ("--torch_dtype", "float32", "--throughput", "10", "--update_period", "5")
        others = [  # these run in this process, loading while alice starts
            stack.enter_context(
                InProcessServer(model, peers, "--block_indices", blocks, *common).start(wait=False)
            )
            for model, blocks in ((llama, "2:4"), (bloom, "0:2"))
        ]
        # alice serves --metrics_port, which only `petals serve` does: a process
        alice_args = ("--metrics_port", str(metrics_port), "--public_name", "alice")
        alice = stack.enter_context(
            start_server(llama, peers, "--block_indices", "0:2", *common, *alice_args, wait_ready=False)
        )
        alice.wait_for_log("Server is ONLINE", timeout=120)
        for server in others:
            server.wait_ready(timeout=120)
        servers = [alice, *others]
        wait_for_announced_pings(peers, LLAMA, alice.peer_id, others[0].peer_id)
        monitor = stack.enter_context(start_monitor(peers, "--update_period", str(UPDATE_PERIOD)))
        yield {
            "peers": peers,
            "servers": servers,
            "monitor": monitor,
            "bloom": bloom,
            "common": common,
            "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics",
        }


def wait_for_announced_pings(peers: list[str], dht_prefix: str, sender: str, receiver: str) -> None:
    """Wait until ``sender`` announces its ping to ``receiver``: a first announcement can come before
    the receiver is announced (the servers start together), and the next one only an update period on."""
    client = WireClient(peers)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            entry = client.dht_get(f"{dht_prefix}.0")
            record = entry.value.get(sender) if entry is not None else None
            if record is not None and receiver in (ServerInfo.from_tuple(record.value).next_pings or {}):
                return
            time.sleep(0.5)
        raise AssertionError(f"{sender} did not announce a ping to {receiver} within 60 s")
    finally:
        client.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def get_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample as ``{(name, sorted labels): value}``, parsed by prometheus_client's own parser."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def report(state: dict, dht_prefix: str) -> dict:
    return next(model for model in state["model_reports"] if model["dht_prefix"] == dht_prefix)


def rows_by_peer(state: dict, dht_prefix: str) -> dict[str, dict]:
    return {row["peer_id"]: row for row in report(state, dht_prefix)["server_rows"]}


def run_health(swarm, *args: str) -> subprocess.CompletedProcess:
    return petals_health(swarm["peers"], *args)


def first_state_fetched_after(url: str, moment: float) -> dict:
    """The first monitor state whose DHT fetch began after ``moment`` (unix time)."""
    deadline = time.monotonic() + 2 * UPDATE_PERIOD + 30  # one period, plus a slow fetch on a busy machine
    while time.monotonic() < deadline:
        state = get_json(url)
        if state["last_updated"] - state["update_duration"] > moment:
            return state
        time.sleep(0.2)
    raise AssertionError(f"the monitor did not update within {deadline} s")


# ---- petals health ---------------------------------------------------------------------------


def test_health_prints_coverage_servers_and_verdict_per_model(swarm):
    result = run_health(swarm)
    assert result.returncode == 1, result.stderr  # BLOOM misses blocks
    llama_at = result.stdout.index(f"{LLAMA} (")  # models of equal size come in dht_prefix order
    bloom_section, llama_section = result.stdout[:llama_at], result.stdout[llama_at:]
    assert "tiny-llama-hf (dht_prefix tiny-llama-hf, 4 blocks): healthy" in llama_section
    assert "blocks 0 ████ 4" in llama_section
    assert "tiny-bloom-petals (dht_prefix tiny-bloom-petals, 4 blocks): missing blocks 2:4" in bloom_section
    assert "blocks 0 ██·· 4" in bloom_section
    header = next(line for line in result.stdout.splitlines() if "peer" in line and "throughput" in line)
    for column in (
        "blocks",
        "state",
        "dtype",
        "quant",
        "adapters",
        "cache/block",
        "cache held",
        "version",
        "public name",
        "pings",
    ):
        assert column in header
    first = swarm["servers"][0]
    row = next(line for line in result.stdout.splitlines() if first.peer_id[-6:] in line)
    assert row.split()[:5] == [f"...{first.peer_id[-6:]}", "0:2", "ONLINE", "10.0", "float32"]
    assert "alice" in row and petals.__version__ in row


def test_health_json_for_one_model_is_the_original_state_document(swarm):
    result = run_health(swarm, LLAMA, "--json")
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    jsonschema.validate(state, STATE_SCHEMA)
    assert [model["dht_prefix"] for model in state["model_reports"]] == [LLAMA]
    assert report(state, LLAMA)["state"] == "healthy"
    llama_rows = rows_by_peer(state, LLAMA)
    first, second = swarm["servers"][:2]
    assert set(llama_rows) == {first.peer_id, second.peer_id}
    row = llama_rows[first.peer_id]
    assert (row["span"]["start"], row["span"]["end"], row["state"]) == (0, 2, "online")
    assert row["span"]["server_info"]["public_name"] == "alice"
    assert row["span"]["server_info"]["state"] == "online"
    assert row["cache_tokens_left_per_block"] > 0
    info = row["span"]["server_info"]  # the budget in bytes, and what sessions hold of it by kind: none
    assert info["cache_bytes"] > 0 and info["cache_bytes_held"] == {"full_attention": 0}
    assert row["cache_memory"] == f"0.0 of {info['cache_bytes'] / 2**20:.1f} MiB"
    assert second.peer_id in row["span"]["server_info"]["next_pings"]  # it pings the server of 2:4
    assert set(llama_rows[second.peer_id]["pings_to_me"]) == {first.peer_id}
    assert state["bootstrap_states"] == ["online"] and state["reachability_issues"] == []


def test_health_of_an_unknown_model_says_which_are_announced(swarm):
    unknown = run_health(swarm, "no-such-model")
    assert unknown.returncode != 0
    assert "'no-such-model' is not announced" in unknown.stderr
    assert LLAMA in unknown.stderr and BLOOM in unknown.stderr


# ---- petals monitor --------------------------------------------------------------------------


def test_monitor_state_api_matches_the_schema(swarm):
    state = get_json(swarm["monitor"].url + "api/v1/state")
    jsonschema.validate(state, STATE_SCHEMA)
    assert state["update_period"] == UPDATE_PERIOD
    assert {model["dht_prefix"]: model["state"] for model in state["model_reports"]} == {
        LLAMA: "healthy",
        BLOOM: "broken",
    }
    assert set(rows_by_peer(state, BLOOM)) == {swarm["servers"][2].peer_id}


def test_is_reachable_dials_the_peer(swarm):
    url = swarm["monitor"].url + "api/v1/is_reachable/"
    answer = get_json(url + swarm["servers"][1].peer_id)
    assert answer["success"] is True and answer["message"] is None
    with pytest.raises(urllib.error.HTTPError) as error:
        get_json(url + "not-a-peer-id")
    assert error.value.code == 400 and json.load(error.value)["success"] is False


def test_monitor_metrics_count_servers_and_blocks(swarm):
    metrics = get_metrics(swarm["monitor"].url + "metrics")
    assert metrics[("petals_swarm_models", ())] == 2
    assert metrics[("petals_swarm_blocks", (("model", LLAMA),))] == 4
    assert metrics[("petals_swarm_blocks_online", (("model", LLAMA),))] == 4
    assert metrics[("petals_swarm_blocks_online", (("model", BLOOM),))] == 2
    assert metrics[("petals_swarm_healthy", (("model", LLAMA),))] == 1
    assert metrics[("petals_swarm_healthy", (("model", BLOOM),))] == 0
    assert metrics[("petals_swarm_servers", (("model", LLAMA), ("state", "online")))] == 2
    assert metrics[("petals_swarm_block_servers_online_min", (("model", BLOOM),))] == 0
    alice = swarm["servers"][0].peer_id
    budget = metrics[
        ("petals_swarm_server_kv_cache_bytes", (("model", LLAMA), ("peer_id", alice), ("use", "budget")))
    ]
    assert budget > 0
    held = (
        "petals_swarm_server_kv_cache_bytes",
        (("model", LLAMA), ("peer_id", alice), ("use", "full_attention")),
    )
    assert held in metrics  # each kind the server hosts has a row, held or not


def test_a_server_joining_and_leaving_shows_in_cli_json_and_metrics(swarm):
    monitor = swarm["monitor"]
    peers = [item for peer in swarm["peers"] for item in ("--initial_peers", peer)]
    watch_args = [
        "petals.cli",
        "health",
        "--loopback",
        *peers,
        "--watch",
        "--update_period",
        str(UPDATE_PERIOD),
    ]
    with SwarmProcess("petals health --watch", watch_args) as watcher:

        def frame_after(count: int, *needles: str) -> str:
            """A frame of the watcher, printed after the first ``count`` ones, containing every needle."""
            frames = lambda: "".join(watcher.stdout_lines).split(CLEAR_SCREEN)[1:]  # noqa: E731
            found = lambda: next((f for f in frames()[count:] if all(n in f for n in needles)), None)  # noqa: E731
            return watcher.wait_for(found, 2 * UPDATE_PERIOD + 30, f"a frame with {needles}")

        def frames_so_far() -> int:
            return len("".join(watcher.stdout_lines).split(CLEAR_SCREEN)) - 1

        watcher.wait_for(frames_so_far, 60, "a first frame")
        joining = InProcessServer(swarm["bloom"], swarm["peers"], "--block_indices", "2:4", *swarm["common"])
        joining.start()
        try:
            short = joining.peer_id[-6:]
            online_at, seen = time.time(), frames_so_far()
            state = first_state_fetched_after(monitor.url + "api/v1/state", online_at)
            assert rows_by_peer(state, BLOOM)[joining.peer_id]["state"] == "online"
            assert report(state, BLOOM)["state"] == "healthy"
            metrics = get_metrics(monitor.url + "metrics")
            assert (
                metrics[
                    (
                        "petals_swarm_server_blocks",
                        (("model", BLOOM), ("peer_id", joining.peer_id), ("state", "online")),
                    )
                ]
                == 2
            )
            assert metrics[("petals_swarm_healthy", (("model", BLOOM),))] == 1
            frame = frame_after(seen, f"...{short}")
            assert "tiny-bloom-petals (dht_prefix tiny-bloom-petals, 4 blocks): healthy" in frame
            assert next(line for line in frame.splitlines() if short in line).split()[2] == "ONLINE"
        finally:
            joining.stop()
        left_at, seen = time.time(), frames_so_far()

        state = first_state_fetched_after(monitor.url + "api/v1/state", left_at)
        assert rows_by_peer(state, BLOOM).get(joining.peer_id, {"state": "offline"})["state"] == "offline"
        assert report(state, BLOOM)["state"] == "broken"
        metrics = get_metrics(monitor.url + "metrics")
        assert metrics[("petals_swarm_servers", (("model", BLOOM), ("state", "online")))] == 1
        assert metrics[("petals_swarm_healthy", (("model", BLOOM),))] == 0
        assert (
            "petals_swarm_server_blocks",
            (("model", BLOOM), ("peer_id", joining.peer_id), ("state", "online")),
        ) not in metrics
        frame = frame_after(seen, "missing blocks 2:4")
        rows = [line for line in frame.splitlines() if short in line]
        assert rows == [] or rows[0].split()[2] == "OFFLINE"

        gone = get_json(monitor.url + "api/v1/is_reachable/" + joining.peer_id)
        assert gone["success"] is False and gone["message"]


def test_the_page_shows_coverage_bars_and_server_rows(swarm, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 620})
            page.goto(swarm["monitor"].url)
            page.wait_for_selector("section.model tr.server")
            llama = page.locator(f'section.model[data-model="{LLAMA}"]')
            bloom = page.locator(f'section.model[data-model="{BLOOM}"]')
            assert llama.locator(".coverage .block.online").count() == 4
            assert bloom.locator(".coverage .block.online").count() == 2
            assert bloom.locator(".coverage .block.missing").count() == 2
            assert llama.locator(".verdict").inner_text() == "healthy"
            assert bloom.locator(".verdict").inner_text() == "missing blocks 2:4"
            first = swarm["servers"][0]
            row = llama.locator(f'tr.server[data-peer-id="{first.peer_id}"]')
            assert row.locator("td.state").inner_text() == "ONLINE"
            assert row.locator("td.blocks").inner_text() == "0:2"
            assert row.locator("td.public-name").inner_text() == "alice"
            assert re.fullmatch(r"0\.0 of \d+\.\d MiB", row.locator("td.cache-held").inner_text())
            assert re.fullmatch(r"0/0/[1-9]\d*", row.locator("td.pages-live-kept-free").inner_text())
            assert row.locator("td.preempted").inner_text() == "0"
            # a server that left in an earlier test may still be listed, OFFLINE, until its record expires
            online = 'tr.server:has(td.state:text-is("ONLINE"))'
            assert llama.locator(online).count() == 2 and bloom.locator(online).count() == 1
            page.screenshot(path=str(tmp_path / "monitor.png"), full_page=True)
            if os.environ.get("PETALS_UPDATE_SCREENSHOTS"):  # refresh the README's picture
                page.screenshot(path=str(SCREENSHOT), full_page=True)

            phone = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True)
            phone.goto(swarm["monitor"].url)
            phone.wait_for_selector("section.model tr.server")
            # the page itself never scrolls sideways on a phone; only the tables do, inside their boxes
            assert phone.evaluate("document.documentElement.scrollWidth") <= 390
        finally:
            browser.close()


# ---- petals serve --metrics_port -------------------------------------------------------------


def test_server_metrics_count_requests_errors_tokens_and_sessions(swarm):
    first = swarm["servers"][0]
    client = WireClient(swarm["peers"])
    try:
        with pytest.raises(Exception, match="does not serve"):
            client.info(first.peer_id, f"{LLAMA}.3")
        stream = client.inference(first.peer_id, [f"{LLAMA}.0", f"{LLAMA}.1"], max_length=8)
        try:
            stream.step(torch.randn(1, 3, 64))
            during = get_metrics(swarm["metrics_url"])
            for _ in range(2):
                stream.step(torch.randn(1, 1, 64))
        finally:
            stream.close()
    finally:
        client.close()
    after = get_metrics(swarm["metrics_url"])
    assert during[("petals_server_open_sessions", ())] == 1
    assert during[("petals_server_kv_cache_bytes", (("use", "used"),))] > 0
    held = during[("petals_server_kv_cache_held_bytes", (("kind", "full_attention"),))]
    assert held == during[("petals_server_kv_cache_bytes", (("use", "used"),))]  # llama: one kind
    assert after[("petals_server_requests_total", (("rpc", "rpc_inference"),))] >= 1
    assert after[("petals_server_request_errors_total", (("kind", "not_served"), ("rpc", "rpc_info")))] == 1
    assert after[("petals_server_inference_step_seconds_count", ())] >= 3
    assert (
        after[("petals_server_tokens_computed_total", ())]
        >= during[("petals_server_tokens_computed_total", ())] + 2
    )
    assert after[("petals_server_compute_batch_size_count", ())] >= 3
    assert after[("petals_server_compute_queue_wait_seconds_count", ())] >= 3
    assert after[("petals_server_blocks", ())] == 2
    assert ("petals_server_events_total", (("event", "pushes_sent"),)) in after


def test_serve_refuses_a_busy_metrics_port_before_serving(tiny_model_path):
    from click.testing import CliRunner

    from petals.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [
            "serve",
            str(tiny_model_path("llama")),
            "--new_swarm",
            "--block_indices",
            "0:1",
            "--throughput",
            "1",
        ]
        result = CliRunner().invoke(main, [*args, "--metrics_port", str(port)])
    assert result.exit_code == 2, result.output
    assert (
        f"cannot serve metrics on 127.0.0.1:{port}" in result.output
        and "pick another --metrics_port" in result.output
    )
