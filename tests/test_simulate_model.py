"""``petals simulate --model``: GPU kinds sized by the plan ``petals serve`` and ``petals plan`` use."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_plan import LLAMA_405B
from transformers import LlamaConfig

from petals.cli import main
from petals.simulate import GpuKind, Scenario, load_scenario, with_model_capacities

# Llama 3.1 405B as `petals serve` holds it on a GPU by default (nf4, bfloat16, 16384 tokens of cache per
# block): 13 blocks on 24 GiB, 48 on 80 GiB, 8 on 16 GiB (tests/test_plan.py counts a block by hand:
# 1,644,495,462 bytes in nf4 + 67,108,864 of cache, beside a 2.29 GiB autograd reserve)
LLAMA_405B_NF4_BLOCKS = {24: 13, 80: 48, 16: 8}


@pytest.fixture(scope="module")
def llama_405b(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("published") / "Llama-3.1-405B"
    LlamaConfig(**LLAMA_405B).save_pretrained(folder)
    return str(folder)


def test_a_model_sizes_the_kinds_that_give_their_memory_and_keeps_typed_ones(llama_405b, tmp_path):
    scenario = tmp_path / "swarm.yml"
    scenario.write_text(
        "servers: 24\nhours: 0.25\nclients: 2\nwarmup_hours: 0\n"
        "gpus:\n"
        "  - {name: rtx4090, share: 3, forward_rps: 2000, inference_rps: 500, memory_gib: 24}\n"
        "  - {name: a100, share: 1, forward_rps: 4000, inference_rps: 700, memory_gib: 80, max_blocks: 40,"
        " cache_sessions: 8}\n"
        "  - {name: typed, share: 1, forward_rps: 300, inference_rps: 120, max_blocks: 5, cache_sessions: 2}\n"
    )
    out = tmp_path / "out.json"
    args = ["simulate", "--scenario", str(scenario), "--model", llama_405b, "--policy", "ours"]
    result = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    planned = json.loads(out.read_text())["scenario"]
    assert planned["blocks"] == 126 and planned["model"] == llama_405b
    rtx4090, a100, typed = planned["gpus"]
    # 16384 tokens of cache per block hold 8 sessions of session_tokens_max (2048) tokens
    assert (rtx4090["max_blocks"], rtx4090["cache_sessions"]) == (LLAMA_405B_NF4_BLOCKS[24], 8)
    assert (a100["max_blocks"], a100["cache_sessions"]) == (LLAMA_405B_NF4_BLOCKS[80], 8)  # not the typed 40
    assert rtx4090["planned_for"] == a100["planned_for"] == llama_405b
    assert (typed["max_blocks"], typed["cache_sessions"], typed["planned_for"]) == (5, 2, None)


def test_the_default_gpu_mix_is_planned_once_for_a_model(llama_405b):
    planned = with_model_capacities(Scenario(model=llama_405b, session_tokens_max=4096))
    kinds = {kind.name: kind for kind in planned.gpus}
    assert kinds["rtx4090-24gb"].max_blocks == kinds["rtx3090-24gb"].max_blocks == LLAMA_405B_NF4_BLOCKS[24]
    assert kinds["a100-80gb"].max_blocks == LLAMA_405B_NF4_BLOCKS[80]
    assert kinds["t4-16gb"].max_blocks == LLAMA_405B_NF4_BLOCKS[16]
    assert {kind.cache_sessions for kind in planned.gpus} == {16384 // 4096}
    assert with_model_capacities(planned) is planned  # planned already: nothing to read again


def test_without_a_model_the_typed_numbers_hold_and_a_memory_alone_is_refused(tmp_path):
    assert Scenario().gpus[0].max_blocks == 40  # the default mix, typed for an 80-block model
    scenario = tmp_path / "memory-only.yml"
    scenario.write_text(
        "gpus:\n  - {name: h100, share: 1, forward_rps: 9000, inference_rps: 900, memory_gib: 80}\n"
    )
    with pytest.raises(ValueError, match="gpu kind 'h100' gives memory_gib only: name a model"):
        load_scenario(scenario)
    with pytest.raises(ValueError, match="gpu kind 'x' needs max_blocks and cache_sessions, or memory_gib"):
        Scenario(gpus=(GpuKind(name="x", share=1, forward_rps=1, inference_rps=1),))
    result = CliRunner().invoke(main, ["simulate", "--scenario", str(scenario), "--hours", "0.25"])
    assert result.exit_code == 1 and "gives memory_gib only" in result.output


def test_a_kind_too_small_for_one_block_says_so(llama_405b):
    tiny = GpuKind(name="tiny", share=1, forward_rps=1, inference_rps=1, memory_gib=3)
    with pytest.raises(ValueError, match=r"gpu kind 'tiny' \(3 GiB\) holds no block of .*Llama-3.1-405B"):
        with_model_capacities(Scenario(model=llama_405b, gpus=(tiny,)))
    result = CliRunner().invoke(main, ["simulate", "--model", llama_405b, "--blocks", "80"])
    assert result.exit_code == 2 and "leave out --blocks" in result.output
