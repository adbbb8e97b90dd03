"""The request checks a server makes before any compute, as pure functions (no swarm needed).

``tests/test_server_bad_inputs.py`` sends the same kinds of requests to a real server over p2p and
checks that the peer receives these refusals; here each rule is pinned down on its own.
"""

from __future__ import annotations

import pytest
import torch

from petals.server.validation import (
    MAX_KEY_CHARACTERS,
    Resume,
    backward_args,
    blocks_named,
    check_adapter,
    check_hidden,
    check_hypo_ids,
    check_keep,
    check_max_length,
    check_output_compression,
    check_prompts,
    check_resume,
    check_step_position,
    forward_args,
    inference_args,
    max_request_bytes,
)
from petals.wire import pack_args_kwargs
from petals.wire_errors import NotServedError, WireError

HIDDEN = 8


@pytest.mark.parametrize(
    ("hidden", "allow_empty", "message"),
    [
        (torch.ones(1, 2, HIDDEN, dtype=torch.int64), False, "must be a floating-point tensor"),
        (torch.randn(2, HIDDEN), False, r"shape \[batch, length, hidden\], got \[2, 8\]"),
        (torch.randn(1, 2, 4), False, "hidden size is 4, this model's is 8"),
        (torch.randn(0, 2, HIDDEN), True, "hidden states are empty"),
        (torch.randn(1, 0, HIDDEN), False, "hidden states are empty"),
        (
            torch.randn(3, 4, HIDDEN),
            False,
            "12 tokens .* more than this server's --max_batch_size 10; split it",
        ),
    ],
)
def test_hidden_states_are_checked(hidden, allow_empty, message):
    with pytest.raises(WireError, match=message):
        check_hidden(hidden, HIDDEN, max_tokens=10, allow_empty=allow_empty)


def test_empty_steps_are_allowed_where_they_open_a_session():
    hidden = torch.randn(2, 0, HIDDEN)
    assert check_hidden(hidden, HIDDEN, max_tokens=10, allow_empty=True) is hidden


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (torch.randn(3, 1, 2), "must be a float tensor"),
        (torch.randn(2, 1, 2, HIDDEN), "do not fit 3 blocks"),
        (torch.randn(3, 4, 2, HIDDEN), "do not fit 3 blocks"),
        (torch.randn(3, 1, 6, HIDDEN), "cover 6 positions but the step has only 5 tokens"),
    ],
)
def test_deep_prompts_must_fit_the_blocks_and_the_step(prompts, message):
    with pytest.raises(WireError, match=message):
        check_prompts(prompts, num_blocks=3, hidden=torch.randn(2, 5, HIDDEN))


def test_absent_prompts_are_none_per_block_and_fitting_ones_split_per_block():
    hidden = torch.randn(2, 5, HIDDEN)
    assert check_prompts(None, 3, hidden) == [None] * 3
    assert check_prompts(torch.empty(0), 3, hidden) == [None] * 3
    assert [prompt.shape for prompt in check_prompts(torch.randn(3, 1, 2, HIDDEN), 3, hidden)] == [
        (1, 2, HIDDEN)
    ] * 3


@pytest.mark.parametrize(
    ("hypo_ids", "message"),
    [
        (torch.tensor([0.0, 1.0]), "hypo_ids must be int64"),
        (torch.tensor([0]), r"hypo_ids must have shape \(2,\)"),
        (torch.tensor([0, 2]), r"hypo_ids must be in \[0, 2\)"),
        (torch.tensor([-1, 0]), r"hypo_ids must be in \[0, 2\)"),
    ],
)
def test_beam_ids_pick_rows_of_the_session(hypo_ids, message):
    with pytest.raises(WireError, match=message):
        check_hypo_ids(hypo_ids, batch_size=2)


def test_uid_chains_name_served_blocks_and_adapters_preloaded_ones():
    served = {"m.0": "block 0", "m.1": "block 1"}
    assert blocks_named("m.1 m.0", served, "m.0 to m.1") == ["block 1", "block 0"]
    with pytest.raises(NotServedError, match="does not serve m.5; it serves m.0 to m.1"):
        blocks_named("m.0 m.5", served, "m.0 to m.1")
    with pytest.raises(WireError, match="names no block uids"):
        blocks_named("", served, "m.0 to m.1")
    assert check_adapter("", ("lora",)) is None and check_adapter("lora", ("lora",)) == "lora"
    with pytest.raises(WireError, match="unknown adapter 'x'; this server has: lora"):
        check_adapter("x", ("lora",))


def test_session_length_and_step_positions():
    assert check_max_length({"max_length": 16}, limit=32) == 16
    with pytest.raises(WireError, match="must carry metadata max_length"):
        check_max_length({}, limit=32)
    with pytest.raises(WireError, match="max_length 64 exceeds this server's --inference_max_length 32"):
        check_max_length({"max_length": 64}, limit=32)
    assert check_step_position(position=5, start=None, new_tokens=3, max_length=8) == 5
    assert check_step_position(position=5, start=2, new_tokens=6, max_length=8) == 2
    with pytest.raises(WireError, match="start_from_position 6 is beyond the 5 tokens"):
        check_step_position(position=5, start=6, new_tokens=1, max_length=8)
    with pytest.raises(WireError, match=r"5 tokens so far \+ 4 new > max_length 8"):
        check_step_position(position=5, start=None, new_tokens=4, max_length=8)


def test_keeping_and_resuming_a_session_name_a_key_and_a_position_within_the_session():
    assert check_keep(None) is None and check_keep("chat-1") == "chat-1"
    assert check_resume(None, max_length=32) is None
    assert check_resume({"key": "chat-1", "position": 32}, max_length=32) == Resume("chat-1", 32)
    for key in ("", "x" * (MAX_KEY_CHARACTERS + 1), 7, ["chat"]):
        with pytest.raises(WireError, match=f"keep must be a string of 1 to {MAX_KEY_CHARACTERS} characters"):
            check_keep(key)
    for resume, message in (
        ("chat-1", "resume must be {'key': str, 'position': int}"),
        ({"key": "chat-1"}, "resume must be {'key': str, 'position': int}"),
        ({"key": "chat-1", "position": 33}, "resume position must be an integer from 0 to max_length 32"),
        ({"key": "chat-1", "position": True}, "resume position must be an integer"),
        ({"key": None, "position": 3}, "resume key must be a string"),
    ):
        with pytest.raises(WireError, match=message.replace("{", "\\{").replace("}", "\\}")):
            check_resume(resume, max_length=32)


def test_args_follow_their_structure():
    hidden, prompts, grads = (
        torch.randn(1, 2, HIDDEN),
        torch.randn(2, 1, 1, HIDDEN),
        torch.randn(1, 2, HIDDEN),
    )
    tensors, structure = pack_args_kwargs(hidden, prompts)
    args = forward_args(tensors, structure, 2, HIDDEN, 100)
    assert args.hidden is hidden and len(args.prompts) == 2 and args.has_prompts and args.tokens == 2
    args, grad = backward_args([hidden, grads, prompts], None, 2, HIDDEN, 100)
    assert grad is grads and args.has_prompts
    with pytest.raises(WireError, match=r"grad_outputs shape \[1, 1, 8\] differs from inputs \[1, 2, 8\]"):
        backward_args([hidden, torch.randn(1, 1, HIDDEN)], None, 2, HIDDEN, 100)
    with pytest.raises(WireError, match="rpc_backward expects"):
        backward_args([hidden], None, 2, HIDDEN, 100)
    step = inference_args([hidden, torch.empty(0), torch.tensor([0])], None, 2, HIDDEN, 100)
    assert step.hypo_ids.tolist() == [0] and not step.has_prompts
    assert (
        inference_args(
            [hidden, torch.empty(0), torch.empty(0, dtype=torch.int64)], None, 2, HIDDEN, 100
        ).hypo_ids
        is None
    )
    with pytest.raises(WireError, match="args_structure names tensor 3 but only 1 were sent"):
        forward_args([hidden], ((b"__T3",), {}), 2, HIDDEN, 100)


def test_output_compression_and_the_largest_request():
    assert check_output_compression(None, 1) is None
    with pytest.raises(WireError, match="output_compression has 2 entries for 1 outputs"):
        check_output_compression([0, 0], 1)
    # hidden states and gradients plus a deep prompt per block, in float64, and room for metadata
    assert (
        max_request_bytes(max_batch_size=10, hidden_size=HIDDEN, num_blocks=3) == 10 * HIDDEN * 8 * 5 + 2**16
    )
