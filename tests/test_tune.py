"""``petals tune`` and trained prompts: a real in-process swarm of a tiny Llama that carries SmolLM2's
tokenizer; prompts files are used by ``from_pretrained``, ``petals generate``, ``petals chat`` and refused
by other models."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import petals
from petals.cli import main
from petals.client.prompts import PromptsFileError, config_sha256
from petals.demo_model import prepare_demo_model
from petals.local_swarm import SwarmProcess
from petals.network.client import LOOPBACK_CLIENT
from petals.testing.inprocess import inprocess_swarm

STEPS = 12
COLORS = ["red", "blue", "green", "black", "white", "gold"]


def tiny_chat_llama(path: Path, tokenizer, seed: int = 0, layers: int = 4) -> Path:
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_demo_model())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tokenizer) -> Path:
    return tiny_chat_llama(tmp_path_factory.mktemp("tune") / "tiny-tune-llama", tokenizer)


@pytest.fixture(scope="module")
def peers(model_path) -> list[str]:
    with inprocess_swarm(model_path, "0:2", "2:4") as (dht, _):
        yield dht.initial_peers


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("data")
    rows = [{"prompt": f"The flag of land {n} is", "completion": f" {COLORS[n % 6]}"} for n in range(24)]
    return write_rows(folder / "train.jsonl", rows[:18]), write_rows(folder / "eval.jsonl", rows[18:])


def peer_args(peers: list[str]) -> list[str]:
    return ["--loopback", *[item for peer in peers for item in ("--initial_peers", peer)]]


def tune_args(model_path, peers, data, out: Path, *more: str) -> list[str]:
    train, held_out = data
    return [
        "tune",
        str(model_path),
        *peer_args(peers),
        *("--data", str(train), "--eval", str(held_out), "--out", str(out), "--steps", str(STEPS)),
        *("--pre_seq_len", "4", "--batch_size", "4", "--lr", "0.05"),
        *more,
    ]


@pytest.fixture(scope="module")
def tuned(model_path, peers, data, tmp_path_factory) -> tuple[Path, dict, str]:
    folder = tmp_path_factory.mktemp("tuned")
    out, metrics = folder / "prompts.safetensors", folder / "metrics.json"
    result = CliRunner().invoke(main, tune_args(model_path, peers, data, out, "--json", str(metrics)))
    assert result.exit_code == 0, result.output
    return out, json.loads(metrics.read_text()), result.output


def test_tune_lowers_the_loss_and_reports_every_step_and_evaluation(tuned):
    _, metrics, output = tuned
    losses = [step["loss"] for step in metrics["steps"]]
    assert [step["step"] for step in metrics["steps"]] == list(range(1, STEPS + 1))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert [evaluation["step"] for evaluation in metrics["evals"]] == [0, STEPS]
    assert metrics["evals"][-1]["loss"] < metrics["evals"][0]["loss"]
    assert all(len(evaluation["answers"]) == 6 for evaluation in metrics["evals"])
    assert "eval after step 0: loss" in output and f"eval after step {STEPS}: loss" in output
    assert "tokens/s" in output and not metrics["interrupted"]


def test_the_prompts_file_says_what_it_was_trained_for(tuned, model_path):
    out, _, _ = tuned
    with safe_open(out, framework="pt") as file:
        metadata = file.metadata()
        shapes = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}
    assert metadata["model"] == model_path.name
    assert (metadata["tuning_mode"], metadata["pre_seq_len"]) == ("deep_ptune", "4")
    assert metadata["config_sha256"] == config_sha256(model_path)
    assert shapes == {"prompt_embeddings": (4, 64), "intermediate_prompt_embeddings": (4, 4 * 64)}


def test_from_pretrained_uses_the_trained_prompts(tuned, model_path, peers, tokenizer):
    out, _, _ = tuned
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=peers, prompts=out, **LOOPBACK_CLIENT
    )
    plain = petals.AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=peers, **LOOPBACK_CLIENT
    )
    try:
        assert (model.config.tuning_mode, model.config.pre_seq_len) == ("deep_ptune", 4)
        with safe_open(out, framework="pt") as file:
            assert torch.equal(
                model.intermediate_prompt_embeddings.weight, file.get_tensor("intermediate_prompt_embeddings")
            )
        ids = tokenizer("The flag of land 3 is", return_tensors="pt").input_ids
        with torch.no_grad():
            tuned_logits, plain_logits = model(input_ids=ids).logits, plain(input_ids=ids).logits
        assert tuned_logits.shape == plain_logits.shape
        assert not torch.allclose(tuned_logits, plain_logits, atol=1e-3)
    finally:
        model.close()
        plain.close()


def test_a_different_model_refuses_the_prompts_in_one_line(tuned, peers, tokenizer, tmp_path):
    out, _, _ = tuned
    other = tiny_chat_llama(tmp_path / "other-llama", tokenizer, layers=2)
    with pytest.raises(PromptsFileError, match="holds prompts trained for tiny-tune-llama"):
        petals.AutoDistributedModelForCausalLM.from_pretrained(
            other, initial_peers=peers, prompts=out, **LOOPBACK_CLIENT
        )
    result = CliRunner().invoke(
        main, ["generate", str(other), *peer_args(peers), "--prompts", str(out), "hi"]
    )
    assert result.exit_code == 1
    error_lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1 and "not for other-llama" in error_lines[0], result.output
    assert "Traceback" not in result.output


def test_bad_data_lines_are_named(model_path, peers, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    result = CliRunner().invoke(
        main, ["tune", str(model_path), *peer_args(peers), "--data", str(bad), "--out", str(tmp_path / "p")]
    )
    assert result.exit_code == 2 and "bad.jsonl line 2: expected" in result.output, result.output


def test_ctrl_c_saves_what_was_trained_so_far(model_path, peers, data, tmp_path):
    out, metrics = tmp_path / "prompts.safetensors", tmp_path / "metrics.json"
    args = tune_args(model_path, peers, data, out, "--json", str(metrics))
    args[args.index("--steps") + 1] = "10000"
    # faulthandler: a tune that does not stop is made to print every thread's stack (seen once in CI, at
    # 60 s, and not in 28 runs here, so what it waits on is still unknown)
    with SwarmProcess("petals tune", ["petals.cli", *args], env={"PYTHONFAULTHANDLER": "1"}) as tune:
        tune.wait_for(lambda: steps_shown(tune.log) >= 3, 180, "three steps")
        tune.process.send_signal(signal.SIGINT)
        try:
            returncode = tune.process.wait(60)
        except subprocess.TimeoutExpired:
            tune.process.send_signal(signal.SIGABRT)
            tune.process.wait(30)
            pytest.fail(f"petals tune did not stop within 60 s of Ctrl-C; its threads:\n{tune.log[-20000:]}")
        assert returncode == 130, tune.log
    written = json.loads(metrics.read_text())
    assert written["interrupted"] and 3 <= len(written["steps"]) < 10000
    assert "Interrupted after" in tune.log and out.is_file()
    with safe_open(out, framework="pt") as file:
        assert file.metadata()["tuning_mode"] == "deep_ptune"


def test_the_first_ctrl_c_asks_the_run_to_stop_and_the_second_stops_it():
    """A flag for the first: an exception raised by a signal handler can be lost (CI saw a tune train
    on for 60 s after its Ctrl-C); a second Ctrl-C raises, for a step that does not end."""
    from petals.cli.tune import stopped_by_ctrl_c

    stop, before = threading.Event(), signal.getsignal(signal.SIGINT)
    with stopped_by_ctrl_c(stop):
        os.kill(os.getpid(), signal.SIGINT)
        wait_until(stop.is_set)  # the handler runs in this thread, between bytecodes
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            wait_until(lambda: False)
    assert signal.getsignal(signal.SIGINT) is before


def wait_until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.01)


def steps_shown(log: str) -> int:
    """The most steps the progress bar has shown (it redraws at most every 0.1 s, so it skips counts)."""
    return max((int(count) for count in re.findall(r"(\d+)/10000 \[", log)), default=0)


def greedy_text(model, tokenizer, text: str, new_tokens: int, chat: bool = False) -> str:
    from petals.cli.generate import encode

    inputs = encode(tokenizer, text, chat)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def references(tuned, model_path, peers):
    """The Python client with the trained prompts, and without: what the commands must print."""
    out, _, _ = tuned
    models = [
        petals.AutoDistributedModelForCausalLM.from_pretrained(
            model_path, initial_peers=peers, **LOOPBACK_CLIENT, **({"prompts": out} if prompts else {})
        )
        for prompts in (True, False)
    ]
    yield models
    for model in models:
        model.close()


def test_generate_and_chat_use_the_prompts_file(tuned, model_path, peers, tokenizer, references):
    out, _, _ = tuned
    with_prompts, plain = references
    expected = greedy_text(with_prompts, tokenizer, "The flag of land 5 is", 8)
    assert expected != greedy_text(plain, tokenizer, "The flag of land 5 is", 8)
    args = [str(model_path), *peer_args(peers), "--prompts", str(out), "--max_new_tokens", "8"]
    result = CliRunner().invoke(main, ["generate", *args, "The flag of land 5 is"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == expected.strip()
    result = CliRunner().invoke(main, ["chat", *args], input="hello there\n/exit\n")
    assert result.exit_code == 0, result.output
    assert greedy_text(with_prompts, tokenizer, "hello there", 8, chat=True).strip() in result.stdout


def test_with_prompts_shares_the_base_models_weights_and_network_and_generates_as_loaded(
    tuned, tokenizer, references
):
    out, _, _ = tuned
    with_prompts, plain = references
    variant = plain.with_prompts(out)  # not closed: it would close plain's connection, which it shares
    assert variant.remote_blocks.network is plain.remote_blocks.network
    base = {name: tensor for name, tensor in plain.named_parameters() if "prompt_embeddings" not in name}
    mine = {name: tensor for name, tensor in variant.named_parameters() if "prompt_embeddings" not in name}
    assert base.keys() == mine.keys() and base
    assert all(mine[name].data_ptr() == base[name].data_ptr() for name in base)  # the same memory, no copy
    assert not any(tensor.requires_grad for tensor in mine.values())
    assert torch.equal(variant.prompt_embeddings.weight, with_prompts.prompt_embeddings.weight)
    text = "The flag of land 5 is"  # test_generate_and_chat_use_the_prompts_file: plain says otherwise
    assert greedy_text(variant, tokenizer, text, 8) == greedy_text(with_prompts, tokenizer, text, 8)
    assert greedy_text(plain, tokenizer, text, 8) != greedy_text(variant, tokenizer, text, 8)


def test_api_serves_the_prompts_as_a_model_of_their_own(tuned, model_path, peers, tokenizer, references):
    import httpx2

    from petals.local_swarm import start_api

    out, _, _ = tuned
    with_prompts, plain = references
    with start_api(model_path, peers, "--prompts", f"flags={out}", "--model_id", "base") as api:
        models = httpx2.get(f"{api.url}/v1/models", timeout=30).json()
        assert [card["id"] for card in models["data"]] == ["base", "flags"]
        for name, reference in (("flags", with_prompts), ("base", plain)):
            body = {"model": name, "prompt": "The flag of land 4 is", "max_tokens": 8, "temperature": 0}
            reply = httpx2.post(f"{api.url}/v1/completions", json=body, timeout=120).json()
            assert reply["choices"][0]["text"] == greedy_text(
                reference, tokenizer, "The flag of land 4 is", 8
            )
            assert reply["model"] == name
        missing = httpx2.post(f"{api.url}/v1/completions", json={**body, "model": "nope"}, timeout=30)
        assert missing.status_code == 404 and "'base', 'flags'" in missing.json()["error"]["message"]


def test_the_demo_data_is_valid_and_its_held_out_sentences_are_not_trained_on():
    from importlib import resources

    from petals.cli.tune import read_rows

    data = resources.files("petals") / "demo_data"
    train, held_out = (read_rows(str(data / name)) for name in ("records_train.jsonl", "records_eval.jsonl"))
    assert len(train) == 60 and len(held_out) == 12
    for row in train + held_out:
        name, city, age = row["completion"].split(" | ")
        assert all(part in row["prompt"] for part in (name, city, age)), row
    assert not {row["prompt"] for row in held_out} & {row["prompt"] for row in train}


def test_the_tune_demo_prints_held_out_answers_before_and_after_and_saves_its_prompts(
    model_path, peers, capsys, monkeypatch
):
    """``petals demo --tune``'s part after the swarm starts (its 30 steps on SmolLM2 are ``make tune-demo``'s):
    the shipped records data, deep prompts, both evaluations, a prompts file a model loads."""
    from petals.cli import demo

    monkeypatch.setitem(demo.TUNE_SETTINGS, "steps", 2)
    saved = model_path.parent / "SmolLM2-records-prompts.safetensors"
    saved.unlink(missing_ok=True)
    timings = {}
    demo.tune_demo(model_path, peers, timings)
    output = capsys.readouterr().out

    assert "Teaching the model to answer 'Record: " in output, output
    assert "(60 training rows, 12 held-out rows, deep prompt tuning)" in output, output
    assert output.count("\n  before: ") == 12 and output.count("\n  after:  ") == 12, output
    assert re.search(r"Exact match on held-out rows: \d+/12 before, \d+/12 after", output), output
    assert f"Saved the prompts to {saved}" in output and f"--prompts {saved}" in output
    # the swarm stops with the demo: the hint names no address of it, but how to keep one running
    assert "petals demo --keep" in output and not any(peer in output for peer in peers), output
    assert timings["tune (with both evaluations)"] > 0 and "  2 training steps" in timings
    model = petals.AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=peers, prompts=saved, **LOOPBACK_CLIENT
    )
    assert model.config.tuning_mode == "deep_ptune" and model.config.pre_seq_len == demo.TUNE_PRE_SEQ_LEN
    model.close()
