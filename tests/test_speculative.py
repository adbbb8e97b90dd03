"""Speculative decoding through the swarm: transformers' assisted generation (a local draft model or
prompt lookup) verifies several tokens per inference step and rolls the remote session back on
rejection, with exactly the tokens of plain greedy generation and transformers' own sampling."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys

import click
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, StoppingCriteria

import petals
from conftest import LOOPBACK_CLIENT
from petals.cli.generate import PROMPT_LOOKUP_TOKENS, speculation_kwargs
from petals.client.generation import StepStats
from petals.server.server import READY_MESSAGE
from petals.testing.swarm import InProcessDht, InProcessServer, start_server

# one swarm for the module: llama over three servers (two hold blocks 2:4, so that one may die)
SERVED = {"llama": ("0:2", "2:4", "2:4"), "bloom": ("0:4",), "falcon-new": ("0:4",), "mixtral": ("0:4",)}
NEW_TOKENS = 12
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
SERVER_ARGS = ("--torch_dtype", "float32", "--update_period", "3")


def start(stack: contextlib.ExitStack, family: str, blocks: str, dht: InProcessDht, path):
    """Llama's servers of blocks 2:4 are processes (a test kills one with SIGKILL), the others run in
    this process; none waits until it is ready."""
    args = ("--block_indices", blocks, *SERVER_ARGS)
    if family == "llama" and blocks == "2:4":
        return stack.enter_context(
            start_server(path, dht.initial_peers, *args, wait_ready=False, wait_joined=False, timeout=180)
        )
    return stack.enter_context(InProcessServer(path, dht.initial_peers, *args).start(wait=False))


@pytest.fixture(scope="module")
def swarm(tiny_model_path):
    """(DHT, {family: its servers}), all ONLINE; the servers start together and load in parallel."""
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        servers = {
            family: [start(stack, family, blocks, dht, tiny_model_path(family)) for blocks in ranges]
            for family, ranges in SERVED.items()
        }
        for server in (server for family in servers.values() for server in family):
            if isinstance(server, InProcessServer):
                server.wait_ready(timeout=180)
            else:
                server.wait_for_log(READY_MESSAGE, timeout=180)
        yield dht, servers


def load(family: str, dht, tiny_model_path):
    """(distributed model, local model, local draft) of one family.

    The draft is the same checkpoint cut to its first two blocks: it agrees with the full model often
    enough to have proposals both accepted and rejected.
    """
    path = tiny_model_path(family)
    remote = petals.AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=dht.initial_peers, request_timeout=20, **LOOPBACK_CLIENT
    )
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, num_hidden_layers=2).eval()
    draft.generation_config.assistant_confidence_threshold = 0.0  # always propose num_assistant_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.num_assistant_tokens = 3
    return remote, local, draft


@pytest.fixture(scope="module", params=list(SERVED))
def models(request, swarm, tiny_model_path):
    remote, local, draft = load(request.param, swarm[0], tiny_model_path)
    yield remote, local, draft
    remote.close()


def repeating_prompt() -> torch.Tensor:
    """A prompt that repeats itself, so that prompt lookup finds candidates."""
    part = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    return torch.cat([part, part, part[:, :3]], dim=1)


def test_greedy_speculation_matches_plain_generation(models):
    remote, local, draft = models
    ids = repeating_prompt()
    expected = local.generate(ids, **GREEDY)
    assert torch.equal(remote.generate(ids, **GREEDY), expected)
    witnessed = {"accepted": 0, "rolled back": 0}
    for speculation in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=draft)):
        with StepStats(remote) as stats:
            output = remote.generate(ids, **speculation, **GREEDY)
        assert torch.equal(output, expected), speculation
        assert max(stats.lengths[1:]) > 1, "no step verified several tokens"
        witnessed["accepted"] += stats.accepted(NEW_TOKENS)
        witnessed["rolled back"] += stats.rolled_back(output.shape[1])
    assert all(witnessed.values()), f"both acceptance and rejection must happen: {witnessed}"
    # prompt lookup may propose past max_length: the session must have room for that
    few = remote.generate(ids, prompt_lookup_num_tokens=10, max_new_tokens=2, do_sample=False)
    assert torch.equal(few, expected[:, : ids.shape[1] + 2])


def test_seeded_speculative_sampling_follows_transformers(models):
    remote, local, draft = models
    ids = repeating_prompt()
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8)
    for speculation in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=draft)):
        torch.manual_seed(0)
        expected = local.generate(ids, **speculation, **kwargs)
        torch.manual_seed(0)
        assert torch.equal(remote.generate(ids, **speculation, **kwargs), expected), speculation


def test_rolled_back_session_continues_as_if_never_longer(models):
    remote, local, _ = models
    with torch.no_grad(), remote.inference_session(max_length=8) as session:
        remote(torch.tensor([[5, 6, 7]]))
        for position in (-1, 4):
            with pytest.raises(
                ValueError, match=f"cannot roll back to position {position}: the session is at 3"
            ):
                session.rollback(position)
        session.rollback(1)
        assert session.position == 1
        logits = remote(torch.tensor([[8, 9]])).logits
        expected = local(torch.tensor([[5, 8, 9]])).logits[:, 1:]
    assert torch.allclose(logits, expected, atol=1e-4), (logits - expected).abs().max()


class KillAfterRollback(StoppingCriteria):
    """Never stops generation; SIGKILLs the server of blocks 2:4 as soon as a step's proposals were rejected."""

    def __init__(self, session, servers, stats: StepStats) -> None:
        self.session, self.servers, self.stats = session, servers, stats
        self.killed = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.killed is None and self.stats.rolled_back(input_ids.shape[1]) > 0:
            (peer_id,) = {str(span.peer_id) for span in self.session.route if span.start == 2}
            self.killed = next(server for server in self.servers if server.peer_id == peer_id)
            self.killed.process.kill()
            self.killed.process.wait()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_failover_after_rollback_replays_only_accepted_tokens(swarm, tiny_model_path):
    dht, servers = swarm
    remote, local, _ = load("llama", dht, tiny_model_path)
    ids = repeating_prompt()
    kwargs = dict(GREEDY, output_logits=True, return_dict_in_generate=True)
    expected = local.generate(ids, **kwargs)
    with (
        remote.inference_session(max_length=ids.shape[1] + NEW_TOKENS) as session,
        StepStats(remote) as stats,
    ):
        killer = KillAfterRollback(session, servers["llama"], stats)
        output = remote.generate(ids, prompt_lookup_num_tokens=3, stopping_criteria=[killer], **kwargs)
        survivors = {str(span.peer_id) for span in session.route}
    remote.close()
    assert killer.killed is not None, "no proposal was rejected before the end"
    assert killer.killed.peer_id not in survivors
    assert torch.equal(output.sequences, expected.sequences)
    # a replay with the rejected positions would shift every later position: the logits show it
    diff = max((a - b).abs().max().item() for a, b in zip(output.logits, expected.logits, strict=True))
    assert diff < 1e-4


def test_speculative_options_are_checked():
    assert speculation_kwargs("prompt-lookup", None) == {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    assert speculation_kwargs("prompt-lookup:4", None) == {"prompt_lookup_num_tokens": 4}
    assert speculation_kwargs(None, None) == {}
    for bad in ("prompt-lookup:0", "prompt-lookup:x", "draft"):
        with pytest.raises(click.BadParameter, match="expected prompt-lookup or prompt-lookup:K"):
            speculation_kwargs(bad, None)
    with pytest.raises(click.UsageError, match="either --speculative or --assistant"):
        speculation_kwargs("prompt-lookup", "some/model")


def test_petals_generate_speculates_with_the_same_text(swarm, tiny_model_path):
    """``petals generate --speculative`` prints the text of plain greedy generation, and its step count."""
    path = tiny_model_path("llama")
    vocabulary = {f"w{index}": index for index in range(1000)}
    words = Tokenizer(WordLevel(vocabulary, unk_token="w0"))
    words.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")
    tokenizer.save_pretrained(path)
    ids = repeating_prompt()
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = tokenizer.decode(local.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :])
    peers = [argument for peer in swarm[0].initial_peers for argument in ("--initial_peers", peer)]
    prompt = tokenizer.decode(ids[0])
    command = ["petals.cli", "generate", str(path), prompt, *peers, "--loopback", "--max_new_tokens", "8"]
    result = subprocess.run(
        [sys.executable, "-m", *command, "--speculative", "prompt-lookup:3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == expected.strip()
    assert re.search(r"\d+ tokens in \d+ steps through the swarm", result.stderr), result.stderr[-2000:]
