"""Prompt tuning survives faults: a server killed (kill -9) and one hung (SIGSTOP) between steps, with new
servers joining, cost at most one step with retried requests each, and the loss curve equals an unfaulted
run with the same seed. Real ``petals serve`` processes (signals need processes) of a tiny Llama."""

from __future__ import annotations

import logging
import signal

import pytest
import torch
from test_tune import COLORS, tiny_chat_llama
from transformers import AutoTokenizer

import petals
from conftest import swarm_with_processes
from petals.cli.tune import Metrics, TuneRun, init_from_vocabulary, make_example
from petals.demo_model import prepare_demo_model
from petals.local_swarm import READY_MESSAGE, start_server
from petals.network.client import LOOPBACK_CLIENT

pytestmark = pytest.mark.slow

STEPS = 10
KILL_AFTER, STOP_AFTER = 3, 6
# records outlive a loaded machine's late announcements; the client bans a failed server for longer
SERVER_ARGS = ("--torch_dtype", "float32", "--update_period", "5", "--expiration", "30")


class RetriedRequests(logging.Handler):
    """Counts the client's "retrying on another route" warnings, by the step they happened in."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.step, self.by_step = 1, {}

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying on another route" in record.getMessage():
            self.by_step[self.step] = self.by_step.get(self.step, 0) + 1


def train(model_path, peers, tokenizer, on_step=None) -> list[float]:
    rows = [{"prompt": f"The flag of land {n} is", "completion": f" {COLORS[n % 6]}"} for n in range(12)]
    torch.manual_seed(0)
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        model_path,
        initial_peers=peers,
        tuning_mode="deep_ptune",
        pre_seq_len=4,
        request_timeout=5,
        update_period=2,
        ban_timeout=60,
        **LOOPBACK_CLIENT,
    )
    try:
        init_from_vocabulary(model, 0)
        examples = [make_example(tokenizer, row, chat=False) for row in rows]
        metrics = Metrics(str(model_path), "deep_ptune", 4)
        TuneRun(model, tokenizer, examples, [], STEPS, 0.05, 3, 0, 0, False, on_step).run(metrics)
    finally:
        model.close()
    assert metrics.retried_steps == []  # every failure was routed around inside its step
    return [step["loss"] for step in metrics.steps]


def test_a_killed_and_a_hung_server_and_new_ones_cost_one_step_each_and_change_no_loss(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(prepare_demo_model())
    model_path = tiny_chat_llama(tmp_path / "tiny-tune-llama", tokenizer)
    retries = RetriedRequests()
    logging.getLogger("petals.client").addHandler(retries)
    swarm = swarm_with_processes(model_path, "0:2", "2:4", processes=2, server_args=SERVER_ARGS[2:])
    with swarm as (dht, (first, second)):
        unfaulted = train(model_path, dht.initial_peers, tokenizer)
        assert retries.by_step == {}
        joined = []

        def fault(step: int) -> None:
            retries.step = step + 1
            if step in (KILL_AFTER, STOP_AFTER):  # a replacement joins, then the old one fails
                blocks = "0:2" if step == KILL_AFTER else "2:4"
                joined.append(
                    start_server(model_path, dht.initial_peers, "--block_indices", blocks, *SERVER_ARGS)
                )
                (first if step == KILL_AFTER else second).process.send_signal(
                    signal.SIGKILL if step == KILL_AFTER else signal.SIGSTOP
                )

        try:
            faulted = train(model_path, dht.initial_peers, tokenizer, on_step=fault)
        finally:
            second.process.send_signal(signal.SIGCONT)
            for server in joined:
                server.stop()
    logging.getLogger("petals.client").removeHandler(retries)
    assert all(READY_MESSAGE in server.log for server in joined)
    torch.testing.assert_close(torch.tensor(faulted), torch.tensor(unfaulted), rtol=1e-4, atol=1e-5)
    # routing may use a replacement before it tries the failed server: the retry comes at a later step
    assert len(retries.by_step) <= 2 and sum(retries.by_step.values()) <= 2, retries.by_step
    assert min(retries.by_step, default=KILL_AFTER + 1) > KILL_AFTER, retries.by_step
