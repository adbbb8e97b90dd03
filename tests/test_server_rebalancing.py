"""--num_blocks servers rebalance: when a range loses its server, a server moves there, and servers
whose best range is the one they serve never reload it (Petals bug #389)."""

from __future__ import annotations

import re

from petals.server.server import READY_MESSAGE
from petals.testing.swarm import ServerProcess, start_dht, start_server

HOSTING = re.compile(r"Hosting blocks (\d+):(\d+)")
STAYING = "Balance check: staying on"
MOVING = "Rebalancing: moving from blocks"


def hosted(server: ServerProcess) -> str | None:
    """The range the server serves now ("start:end"), or None while it is loading one."""
    lines = server.log_lines[:]
    starts = [index for index, line in enumerate(lines) if HOSTING.search(line)]
    if not starts or not any(READY_MESSAGE in line for line in lines[starts[-1] :]):
        return None
    return ":".join(HOSTING.search(lines[starts[-1]]).groups())


def ranges(servers) -> list[str]:
    """The ranges the servers serve, sorted; "loading" for one between ranges."""
    return sorted(hosted(server) or "loading" for server in servers)


def count(server: ServerProcess, text: str) -> int:
    return sum(text in line for line in server.log_lines[:])


def test_a_server_moves_to_an_abandoned_range_and_the_others_stay(tiny_model_path):
    model = tiny_model_path("llama")
    args = ("--num_blocks", "2", "--throughput", "1.0", "--mean_balance_check_period", "1")
    with start_dht() as dht:
        first = start_server(model, dht.initial_peers, *args)
        with first, start_server(model, dht.initial_peers, *args) as second:
            third = start_server(model, dht.initial_peers, *args)
            with third:
                assert [hosted(first), hosted(second), hosted(third)] == ["0:2", "2:4", "0:2"]
                crowded = (first, third)
                # two servers on 0:2, one on 2:4: each is where it should be, and keeps its blocks
                for server in crowded:
                    server.wait_for(
                        lambda s=server: count(s, "still the best range") >= 2, 20, "balance checks"
                    )
                assert all(count(server, MOVING) == 0 for server in (first, second, third))

                second.stop()  # 2:4 loses its only server: one of the 0:2 servers must move there
                for server in crowded:
                    server.wait_for(lambda: ranges(crowded) == ["0:2", "2:4"], 60, "a rebalanced swarm")
                assert sum(count(server, MOVING) for server in crowded) >= 1
                moved = next(server for server in crowded if hosted(server) == "2:4")
                assert "moving from blocks 0:2 to 2:4" in moved.log

                # balanced again: from now on both stay, without reloading their blocks
                loads = {server: count(server, READY_MESSAGE) for server in crowded}
                stays = {server: count(server, STAYING) for server in crowded}
                for server in crowded:
                    server.wait_for(lambda s=server: count(s, STAYING) >= stays[s] + 3, 30, "balance checks")
                assert {server: count(server, READY_MESSAGE) for server in crowded} == loads
                assert ranges(crowded) == ["0:2", "2:4"]
