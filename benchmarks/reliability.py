"""``make reliability``: a seeded, bounded attack-and-fault suite against a real local swarm.

    python -m benchmarks.reliability [--short] [--seed N]

1. Malformed requests over every RPC (and garbage DHT records under the blocks' keys), drawn from
   a seeded generator: the server must answer each with an error or a result, never die, and give
   back every byte of KV cache; its RSS is reported before and after.
2. Concurrent client processes generating greedily through the swarm: errors, and whether each
   output equals local transformers.
3. Faults during generation (a server stopped with SIGSTOP; a server's Python process killed while
   its p2p daemon lives): the time from the fault to the next token, and equal outputs.
4. Servers that lie (``benchmarks.trust``): a server perturbing its outputs against a client with
   ``verify`` (and what ``verify`` costs), a server announcing 1000x its throughput, and 200 fake
   server records under the blocks' keys.
5. ``petals api`` probed as a hostile client would: seeded malformed bodies, values, headers, form
   posts and WebSocket messages interleaved with valid requests and with streams whose clients leave
   halfway; every malformed one must be a 4xx in OpenAI's shape with no traceback or path, every valid
   one served, the process up, no generation place or KV cache left held. Also reported: the latency of
   ``/v1/models`` while four 1 MiB prompts are tokenized and, outside ``--short``, the only server
   stopped for 8 s during 32 streams (how each stream ended, and how soon a new request is answered).

Everything runs on 127.0.0.1 (``--loopback``), is bounded in count and time, and stops what it
started. Exits non-zero when any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import psutil
import torch
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from transformers import AutoModelForCausalLM, LlamaConfig, StoppingCriteria

from benchmarks.trust import run_trust, trust_checks
from petals.api.text import MAX_STOP_LENGTH
from petals.bounded_msgpack import MsgpackLimitError, check_msgpack
from petals.data_structures import make_uids
from petals.formats.gguf import local_model
from petals.testing.malformed import nested_metadata, nested_tuples
from petals.testing.swarm import LOOPBACK_CLIENT, running_swarm, start_api, start_dht, start_server
from petals.testing.wire_client import WireClient, make_request
from petals.wire import request_parts, serialize_tensor, write_metadata
from petals.wire_errors import error_kind

HIDDEN = 64
PREFIX = "reliability-llama-hf"
UIDS = make_uids(PREFIX, 0, 4)
SERVER_LIMITS = ("--inference_max_length", "32", "--max_batch_size", "64", "--attn_cache_tokens", "64")
UNARY = ("rpc_forward", "rpc_backward", "rpc_push")
STREAMS = ("rpc_forward_stream", "rpc_backward_stream", "rpc_inference")


# ---- a tiny model in the Hugging Face layout ----------------------------------------------------


def save_tiny_llama(directory: Path) -> Path:
    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
    )
    torch.manual_seed(0)
    path = directory / "reliability-llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


# ---- malformed requests -------------------------------------------------------------------------


def _tensor(rng: random.Random, tokens: int | None = None) -> torch.Tensor:
    return torch.randn(1, tokens or rng.randint(1, 4), HIDDEN)


def _valid(rng: random.Random, **metadata) -> runtime_pb2.ExpertRequest:
    return make_request(UIDS, [_tensor(rng), torch.empty(0)], metadata)


def _with(request: runtime_pb2.ExpertRequest, **fields) -> runtime_pb2.ExpertRequest:
    copy = runtime_pb2.ExpertRequest()
    copy.CopyFrom(request)
    for name, value in fields.items():
        if name == "tensors":
            del copy.tensors[:]
            copy.tensors.extend(value)
        else:
            setattr(copy, name, value)
    return copy


def _bad_uid(rng: random.Random) -> runtime_pb2.ExpertRequest:
    uid = rng.choice(
        ["", " ", f"{PREFIX}.99", "nobody.0", "x" * 20_000, f"{PREFIX}.1 {PREFIX}.0", "\udcff".encode(
            "utf-8", "surrogatepass").decode("latin-1"), f"{PREFIX}.-1", " ".join(UIDS * 500)]
    )  # fmt: skip
    return _with(_valid(rng), uid=uid)


def _bad_metadata(rng: random.Random) -> runtime_pb2.ExpertRequest:
    raw = rng.choice(
        [
            lambda: rng.randbytes(rng.randint(1, 300)),
            lambda: nested_metadata(rng.randint(33, 400)),
            lambda: nested_tuples(rng.randint(33, 400)),
            lambda: write_metadata({"session_id": "x"})[: rng.randint(1, 5)],
            lambda: msgpack.packb(rng.choice([[1, 2], 7, "text", None, {1: 2}, b"bytes"])),
            lambda: write_metadata({rng.choice(_FIELDS): _junk(rng)}),
            lambda: write_metadata({"args_structure": _junk_structure(rng)}),
            lambda: b"\xdd\xff\xff\xff\xff",
        ]
    )()
    return _with(_valid(rng), metadata=raw)


_FIELDS = [
    "session_id", "step_id", "max_length", "alloc_timeout", "points", "active_adapter",
    "start_from_position", "next_servers", "pushed", "output_compression", "args_structure",
]  # fmt: skip


def _junk(rng: random.Random):
    return rng.choice(
        [-1, 2**62, -(2**62), 1.5, float("nan"), "x" * rng.randint(0, 5000), b"\x00", [1, "a"], {"k": 1},
         None, True, [["peer", "session", 0, 999]], ("a",), [7]]
    )  # fmt: skip


def _junk_structure(rng: random.Random):
    return rng.choice(
        [
            ((b"__T9",), {}),
            ((b"__Tx",), {}),
            (("str",), {}),
            ((b"__T0",), {"kw": b"__T1"}),
            (1, 2, 3),
            [],
            "s",
        ]
    )


def _bad_tensors(rng: random.Random) -> runtime_pb2.ExpertRequest:
    good = serialize_tensor(_tensor(rng))
    bad = runtime_pb2.Tensor()
    bad.CopyFrom(good)
    mutation = rng.randrange(9)
    if mutation == 0:
        bad.dtype = rng.choice(["object", "float8", "int8", "bool", "complex64", "", "<f4", "x" * 300])
    elif mutation == 1:
        bad.buffer = bad.buffer[: rng.randint(0, len(bad.buffer) - 1)]
    elif mutation == 2:
        bad.buffer = bad.buffer + rng.randbytes(rng.randint(1, 64))
    elif mutation == 3:
        del bad.size[:]
        bad.size.extend(
            rng.choice([[1, 2], [1, 1, 1, HIDDEN], [3, 2, HIDDEN], [2**30, 2**30, HIDDEN], [0, 0, HIDDEN]])
        )
    elif mutation == 4:
        bad.compression = rng.choice([2, 3, 4, 5, 99, -1])
    elif mutation == 5:
        bad = serialize_tensor(torch.randn(1, 2, rng.choice([1, 32, 65, 128])))
    elif mutation == 6:
        bad = serialize_tensor(torch.randint(0, 9, (1, 2, HIDDEN)))
    elif mutation == 7:
        bad = serialize_tensor(torch.randn(1, 100, HIDDEN))  # more tokens than --max_batch_size
    else:
        bad.chunks = rng.randint(2, 9)
    prompts = rng.choice([torch.empty(0), torch.randn(2, 1, 1, HIDDEN), torch.randn(4, 1, 9, HIDDEN)])
    return _with(_valid(rng), tensors=[bad, serialize_tensor(prompts)])


def _bad_inference(rng: random.Random) -> list[runtime_pb2.ExpertRequest]:
    """A session whose first or later step is wrong."""
    session = {"session_id": str(uuid.uuid4()), "max_length": 16}
    first = make_request(UIDS, [_tensor(rng, 2), torch.empty(0), torch.empty(0, dtype=torch.int64)], session)
    mutation = rng.randrange(7)
    if mutation == 0:
        return [_with(first, metadata=write_metadata({"session_id": "s"}))]  # no max_length
    if mutation == 1:
        return [_with(first, metadata=write_metadata({**session, "max_length": rng.choice([33, 10**9])}))]
    later_metadata = {"session_id": session["session_id"], "step_id": str(uuid.uuid4())}
    hidden = _tensor(rng, 1)
    hypo_ids = torch.empty(0, dtype=torch.int64)
    if mutation == 2:
        later_metadata["start_from_position"] = rng.choice([3, 99])
    elif mutation == 3:
        hidden = torch.randn(2, 1, HIDDEN)  # another batch size
    elif mutation == 4:
        hidden = _tensor(rng, 15)  # past max_length
    elif mutation == 5:
        hypo_ids = rng.choice([torch.tensor([5]), torch.tensor([0.5]), torch.tensor([[0]])])
    else:
        return [first, _bad_metadata(rng)]
    return [first, make_request(UIDS, [hidden, torch.empty(0), hypo_ids], later_metadata)]


def _bad_stream_parts(rng: random.Random) -> list[runtime_pb2.ExpertRequest]:
    request = _valid(rng)
    parts = request_parts(request.uid, list(request.tensors), request.metadata)
    tail = runtime_pb2.Tensor(buffer=rng.randbytes(16))  # a part with no header
    return rng.choice([[_with(parts[0], tensors=[tail])], [*parts, _with(parts[0], tensors=[tail])], []])


def malformed_requests(seed: int, count: int) -> Iterator[tuple[str, list[runtime_pb2.ExpertRequest]]]:
    """``count`` (method, requests) pairs; unary methods get exactly one request."""
    rng = random.Random(seed)
    makers: list[Callable[[random.Random], runtime_pb2.ExpertRequest]] = [
        _bad_uid,
        _bad_metadata,
        _bad_tensors,
    ]
    for index in range(count):
        method = (*UNARY, *STREAMS)[index % (len(UNARY) + len(STREAMS))]
        if method == "rpc_inference" and rng.random() < 0.6:
            yield method, _bad_inference(rng)
        elif method in ("rpc_forward_stream", "rpc_backward_stream") and rng.random() < 0.2:
            yield method, _bad_stream_parts(rng)
        else:
            yield method, [rng.choice(makers)(rng)]


# ---- 1: malformed requests ----------------------------------------------------------------------


def run_malformed(model_path: Path, seed: int, count: int, dht_values: int) -> dict:
    with (
        start_dht() as dht,
        start_server(
            model_path, dht.initial_peers, "--block_indices", "0:4", "--throughput", "1", *SERVER_LIMITS
        ) as server,
    ):
        client = WireClient(dht.initial_peers)
        try:
            initial_cache = client.info(server.peer_id)["cache_tokens_available"]
            client.forward(server.peer_id, UIDS, torch.randn(1, 3, HIDDEN))
            rss_before = psutil.Process(server.pid).memory_info().rss
            outcomes: Counter[str] = Counter()
            started = time.perf_counter()
            for method, requests in malformed_requests(seed, count):
                outcomes[_send(client, server.peer_id, method, requests)] += 1
                if server.process.poll() is not None:
                    break
            outcomes.update(_store_garbage(client, server.peer_id, dht, seed, dht_values))
            seconds = time.perf_counter() - started
            alive = server.process.poll() is None
            cache = _settled_cache(client, server.peer_id, initial_cache) if alive else None
            rss_after = psutil.Process(server.pid).memory_info().rss if alive else None
            still_serves = (
                alive and client.forward(server.peer_id, UIDS, torch.randn(1, 3, HIDDEN)).shape[1] == 3
            )
            records = client.module_infos(UIDS[:1])[0].servers if alive else {}
        finally:
            client.close()
    return {
        "requests": count,
        "dht_records": dht_values,
        "seconds": round(seconds, 1),
        "outcomes": dict(sorted(outcomes.items())),
        "server_crashed": not alive,
        "server_still_serves": bool(still_serves),
        "dht_still_lists_the_server": len(records) == 1,
        "leaked_cache_tokens": None if cache is None else initial_cache - cache,
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_after_mib": None if rss_after is None else round(rss_after / 2**20, 1),
    }


def _send(client: WireClient, peer: str, method: str, requests: list[runtime_pb2.ExpertRequest]) -> str:
    try:
        if method in UNARY:
            client.call(peer, method, requests[0])
        elif method == "rpc_inference" and len(requests) > 1:
            stream = client.inference(peer, UIDS, max_length=16)
            stream.send(requests[0])
            stream.send(requests[1])
            stream.close()
        else:
            client.call_stream(peer, method, requests)
    except Exception as error:
        kind = error_kind(str(error))
        return f"refused [{kind}]" if kind else f"failed ({type(error).__name__})"
    return "answered"


def _store_garbage(client: WireClient, peer: str, dht, seed: int, count: int) -> Counter[str]:
    """Garbage values and subkeys stored under the blocks' keys, on the server and the bootstrap peer."""
    rng = random.Random(seed + 1)
    outcomes: Counter[str] = Counter()
    honest_subkey = msgpack.packb(PeerID(b"\x00" * 34).to_base58())
    peers = [peer, dht.initial_peers[0].rsplit("/p2p/", 1)[1]]
    for index in range(count):
        garbage = rng.choice(
            [nested_tuples(rng.randint(33, 300)), rng.randbytes(rng.randint(1, 200)), b"\xc1", msgpack.packb([1] * 9)]
        )  # fmt: skip
        as_subkey = index % 2 == 1
        request = dht_pb2.StoreRequest(
            keys=[DHTID.generate(source=rng.choice(UIDS)).to_bytes()],
            subkeys=[garbage if as_subkey else honest_subkey],
            values=[msgpack.packb("ok") if as_subkey else garbage],
            expiration_time=[get_dht_time() + 30],
            in_cache=[False],
            peer=client.node.protocol.node_info,
        )
        stub = client.node.protocol.get_stub(PeerID.from_base58(peers[index % 2]))
        try:
            stored = any(client.run(stub.rpc_store(request)).store_ok)
        except Exception:  # the peer refused the whole request
            stored = False
        what = "malformed" if _is_malformed(garbage) else "well-formed junk"
        outcomes[f"dht: {what} record {'STORED' if stored else 'refused'}"] += 1
    return outcomes


def _is_malformed(raw: bytes) -> bool:
    try:
        check_msgpack(raw)
    except MsgpackLimitError:
        return True
    return False


def _settled_cache(client: WireClient, peer: str, initial: int, wait: float = 10) -> int:
    deadline = time.monotonic() + wait
    while (tokens := client.info(peer)["cache_tokens_available"]) != initial and time.monotonic() < deadline:
        time.sleep(0.1)
    return tokens


# ---- 2: concurrent client processes -------------------------------------------------------------

CLIENT_SCRIPT = """
import json, sys, torch, petals
from petals.testing.swarm import LOOPBACK_CLIENT
path, peers, seed, tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = petals.AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=peers, **LOOPBACK_CLIENT)
ids = torch.randint(3, 1000, (1, 4 + seed % 5), generator=torch.Generator().manual_seed(seed))
output = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
print(json.dumps(output[0].tolist()))
model.close()
"""


def run_concurrent_clients(model_path: Path, clients: int, tokens: int) -> dict:
    local = local_model(model_path, dtype=torch.float32)
    with running_swarm(model_path, "0:2", "2:4") as (dht, _):
        started = time.perf_counter()
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    CLIENT_SCRIPT,
                    str(model_path),
                    json.dumps(dht.initial_peers),
                    str(seed),
                    str(tokens),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for seed in range(clients)
        ]
        results = []
        for process in processes:
            try:
                out, err = process.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            results.append((process.returncode, out, err))
        seconds = time.perf_counter() - started
    errors, equal = 0, 0
    for seed, (code, out, err) in enumerate(results):
        if code != 0:
            errors += 1
            print(f"client {seed} failed:\n{err[-2000:]}", file=sys.stderr)
            continue
        ids = torch.randint(3, 1000, (1, 4 + seed % 5), generator=torch.Generator().manual_seed(seed))
        expected = local.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        equal += json.loads(out.strip().splitlines()[-1]) == expected[0].tolist()
    return {"clients": clients, "tokens_each": tokens, "errors": errors, "outputs_equal_local": equal,
            "seconds": round(seconds, 1)}  # fmt: skip


# ---- 3: faults during generation ----------------------------------------------------------------


class _FaultAfter(StoppingCriteria):
    def __init__(self, model, servers, prompt_length: int, after: int, fault: Callable) -> None:
        self.model, self.servers, self.prompt_length, self.after, self.fault = (
            model,
            servers,
            prompt_length,
            after,
            fault,
        )
        self.faulted = self.fault_time = self.recovery = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_length
        if self.faulted is None and generated == self.after:
            route = self.model.remote_blocks.active_session.route
            peer = next(str(span.peer_id) for span in route if span.start == 2)
            self.faulted = next(server for server in self.servers if server.peer_id == peer)
            self.fault(self.faulted)
            self.fault_time = time.monotonic()
        elif self.faulted is not None and self.recovery is None:
            self.recovery = time.monotonic() - self.fault_time
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _sigstop(server) -> None:
    server.process.send_signal(signal.SIGSTOP)


def _kill_python(server) -> None:
    server.orphans = psutil.Process(server.pid).children(recursive=True)
    server.process.kill()
    server.process.wait()


FAULTS = {"SIGSTOP of a server": _sigstop, "kill -9 of a server's Python (p2pd lives)": _kill_python}


def run_faults(model_path: Path, tokens: int) -> dict:
    import petals

    local = local_model(model_path, dtype=torch.float32)
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    expected = local.generate(ids, **kwargs)
    report = {}
    for name, fault in FAULTS.items():
        with running_swarm(model_path, "0:2", "2:4", "2:4") as (dht, servers):
            model = petals.AutoDistributedModelForCausalLM.from_pretrained(
                model_path, initial_peers=dht.initial_peers, **LOOPBACK_CLIENT
            )
            criteria = _FaultAfter(model, servers, ids.shape[1], tokens // 3, fault)
            try:
                output = model.generate(ids, stopping_criteria=[criteria], **kwargs)
            finally:
                model.close()
                _release(criteria.faulted)
        report[name] = {
            "recovery_seconds": None if criteria.recovery is None else round(criteria.recovery, 2),
            "output_equals_local": bool(torch.equal(output, expected)),
        }
    return report


def _release(server) -> None:
    if server is None:
        return
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGCONT)
    for orphan in getattr(server, "orphans", []):
        with contextlib.suppress(psutil.NoSuchProcess):
            orphan.kill()


# ---- 5: petals api against hostile clients -------------------------------------------------------


def save_tiny_chat_llama(directory: Path) -> Path:
    """A random 4-block Llama over the demo model's tokenizer (the API needs one), saved with it."""
    from benchmarks.chat_model import save_tiny_chat_llama as save

    return save(directory / "reliability-chat-llama")


VALID_COMPLETION = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
# none of them is valid for any of these fields
JUNK_FIELDS = ["max_tokens", "temperature", "top_p", "seed", "stream", "n", "model"]
JUNK_VALUES = ["3", "yes", "true", 2**70, -(2**70), "x" * 5000, {}, [[1]], 1e308]
PYTHON_INTERNALS = ("Traceback", "KeyError", "TypeError", "IndexError", "OverflowError", "AttributeError")


def _valid_body(model_id: str, rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return {"model": model_id, **VALID_COMPLETION}
    return {
        "model": model_id,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "temperature": 0,
    }


def _route(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


JSON_TYPE = {"Content-Type": "application/json"}
FORM_TYPE = {"Content-Type": "application/x-www-form-urlencoded"}
Probe = tuple[str, str, dict, bytes]  # method, path, headers, body


def _json_post(body: dict, **changes) -> Probe:
    return "POST", _route(body), JSON_TYPE, json.dumps({**body, **changes}).encode()


def _truncated(body: dict, rng: random.Random) -> Probe:
    raw = json.dumps(body).encode()
    return "POST", _route(body), JSON_TYPE, raw[: rng.randint(1, len(raw) - 1)]


def _non_json_number(body: dict, rng: random.Random) -> Probe:
    number = rng.choice(["NaN", "Infinity", "1e400", "-0.5"])
    return "POST", _route(body), JSON_TYPE, f'{json.dumps(body)[:-1]}, "temperature": {number}}}'.encode()


def _deep(body: dict, rng: random.Random) -> Probe:
    depth = rng.choice([100, 5000, 100_000])
    return "POST", _route(body), JSON_TYPE, b"[" * depth + b"]" * depth


def _form(body: dict, rng: random.Random) -> Probe:
    fields = rng.choice(
        ["inputs=Hi", "max_new_tokens=5", "inputs=Hi&max_new_tokens=1e400", "inputs=Hi&max_new_tokens=2&do_sample=yes",
         "inputs=Hi&max_new_tokens=2&do_sample=1&temperature=nan"]
    )  # fmt: skip
    return "POST", "/api/v1/generate", FORM_TYPE, fields.encode()


def _bad_messages(body: dict, rng: random.Random) -> Probe:
    messages = rng.choice([[], [{"role": "robot", "content": "x"}], [{"content": "x"}], "text", [1]])
    return _json_post({"model": body["model"], "messages": messages, "max_tokens": 3})


def _bad_prompt_ids(body: dict, rng: random.Random) -> Probe:
    return _json_post({"model": body["model"], **VALID_COMPLETION}, prompt=[rng.choice([-1, 2**70])])


def _foreign(body: dict, rng: random.Random) -> Probe:
    headers = rng.choice([{"Host": "evil.example"}, {"Origin": "http://evil.example"}, {"Origin": "null"}])
    return "POST", _route(body), {**JSON_TYPE, **headers}, json.dumps(body).encode()


# requests that must be refused with a 4xx, each from a valid body and the seeded generator
MALFORMED: list[Callable[[dict, random.Random], Probe]] = [
    lambda body, rng: ("POST", _route(body), JSON_TYPE, rng.randbytes(rng.randint(1, 300))),
    _truncated,
    lambda body, rng: _json_post(body, **{rng.choice(JUNK_FIELDS): rng.choice(JUNK_VALUES)}),
    _non_json_number,
    _deep,
    lambda body, rng: _json_post(body, stop=rng.choice([["s"] * rng.randint(5, 10_000), "x" * (MAX_STOP_LENGTH + 1)])),
    _bad_messages,
    _bad_prompt_ids,
    lambda body, rng: ("POST", _route(body), {"Content-Type": "text/plain"}, json.dumps(body).encode()),
    _form,
    _foreign,
    lambda body, rng: (*rng.choice([("GET", "/v1/completions"), ("DELETE", "/v1/models"), ("GET", "/no/such")]), {}, b""),
]  # fmt: skip


WS_JUNK = [
    b"\x00binary",
    "not json",
    "[1, 2]",
    '{"type": "generate", "inputs": "Hi", "max_new_tokens": 1e400}',
    '{"type": "generate", "inputs": "Hi", "max_new_tokens": 2, "do_sample": 1, "temperature": NaN}',
    '{"type": "generate", "inputs": "Hi", "max_new_tokens": 2, "stop_sequence": 5}',
    '{"type": "generate", "max_new_tokens": 2}',
    '{"type": "generate", "inputs": 7, "max_new_tokens": 2}',
    json.dumps(
        {"type": "generate", "inputs": "Hi", "stop_sequence": "</s>", "extra_stop_sequences": ["x"] * 10_000}
    ),
    '{"type": "what"}',
]


def _is_clean_refusal(status: int, text: str) -> bool:
    """A 4xx whose body is OpenAI's error shape, without a traceback, a path or a raw Python error."""
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        400 <= status < 500
        and bool(error.get("message"))
        and "type" in error
        and not any(word in text for word in PYTHON_INTERNALS)
        and ".py" not in text
    )


class _APIProbes:
    """Seeded probes of one ``petals api`` process; ``outcomes`` counts what each kind was answered."""

    def __init__(self, url: str, model_id: str, rng: random.Random) -> None:
        import httpx2

        self.url, self.model_id, self.rng = url, model_id, rng
        self.http = httpx2.Client(base_url=url, timeout=120)
        self.outcomes: Counter[str] = Counter()
        self.valid_seconds: list[float] = []

    def malformed_http(self) -> None:
        method, path, headers, body = self.rng.choice(MALFORMED)(
            _valid_body(self.model_id, self.rng), self.rng
        )
        response = self.http.request(method, path, headers=headers, content=body)
        clean = _is_clean_refusal(response.status_code, response.text)
        self.outcomes[f"malformed: {'4xx in OpenAI shape' if clean else f'BAD {response.status_code}'}"] += 1
        if not clean:
            print(
                f"API probe {method} {path} {body[:80]!r} -> {response.status_code} {response.text[:300]}",
                file=sys.stderr,
            )

    def malformed_websocket(self) -> None:
        from websockets.sync.client import connect

        with connect(self._ws_url(), open_timeout=30) as websocket:
            websocket.send(json.dumps({"type": "open_inference_session", "max_length": 32}))
            assert json.loads(websocket.recv(timeout=60)) == {"ok": True}
            websocket.send(self.rng.choice(WS_JUNK))
            text = websocket.recv(timeout=60)
        reply = json.loads(text)
        clean = (
            reply.get("ok") is False
            and "error" in reply
            and not any(word in text for word in PYTHON_INTERNALS)
        )
        self.outcomes[f"malformed websocket: {'clean error' if clean else 'BAD'}"] += 1

    def valid(self) -> None:
        body = _valid_body(self.model_id, self.rng)
        started = time.perf_counter()
        response = self.http.post(_route(body), json=body)
        self.valid_seconds.append(time.perf_counter() - started)
        self.outcomes[
            f"valid: {'200' if response.status_code == 200 else f'FAILED {response.status_code}'}"
        ] += 1

    def leaving_stream(self) -> None:
        """A stream whose client leaves after its first event."""
        body = {**_valid_body(self.model_id, self.rng), "max_tokens": 200, "stream": True}
        with self.http.stream("POST", _route(body), json=body) as response:
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
        self.outcomes[f"leaving stream: {'left after its first event' if first else 'BAD'}"] += 1

    def leaving_websocket(self) -> None:
        """A WebSocket closed in the middle of a streamed turn."""
        from websockets.sync.client import connect

        with connect(self._ws_url(), open_timeout=30) as websocket:
            websocket.send(json.dumps({"type": "open_inference_session", "max_length": 200}))
            assert json.loads(websocket.recv(timeout=60)) == {"ok": True}
            turn = {
                "type": "generate",
                "inputs": "Go on:",
                "max_new_tokens": 1,
                "stop_sequence": "never-said",
            }
            websocket.send(json.dumps(turn))
            reply = json.loads(websocket.recv(timeout=60))
        self.outcomes[f"leaving websocket: {'left mid-turn' if reply.get('ok') else 'BAD'}"] += 1

    def gauge(self, name: str, until: float = 0, wait: float = 30) -> float:
        """A gauge of the API's ``/metrics``, read until it has the value ``until`` (or ``wait`` is over)."""
        deadline = time.monotonic() + wait
        while True:
            lines = self.http.get("/metrics").text.splitlines()
            value = float(next(line.split()[1] for line in lines if line.startswith(f"{name} ")))
            if value == until or time.monotonic() > deadline:
                return value
            time.sleep(0.2)

    def models_latency_during_long_prompts(self, characters: int) -> dict[str, float]:
        """The slowest ``/v1/models`` answer while four prompts of ``characters`` are tokenized (then
        refused, beyond the context), asked again and again until the last of those is answered."""
        import threading

        prompt = ("The quick brown fox jumps over the lazy dog. " * (characters // 45 + 1))[:characters]
        body = {"model": self.model_id, **VALID_COMPLETION, "prompt": prompt}
        threads = [threading.Thread(target=self.http.post, args=("/v1/completions",), kwargs={"json": body})
                   for _ in range(4)]  # fmt: skip
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        latencies = []
        while any(thread.is_alive() for thread in threads):
            asked = time.perf_counter()
            self.http.get("/v1/models")
            latencies.append(time.perf_counter() - asked)
        return {
            "models_max_seconds_during_4_long_prompts": round(max(latencies, default=0.0), 3),
            "models_p50_seconds_during_4_long_prompts": round(float(np.median(latencies or [0.0])), 4),
            "models_asked_during_4_long_prompts": len(latencies),
            "long_prompts_answered_after_seconds": round(time.perf_counter() - started, 2),
        }

    def _ws_url(self) -> str:
        return self.url.replace("http", "ws", 1) + "/api/v2/generate"


def run_api_probes(seed: int, count: int, long_prompt: int, stall: bool) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        model_path = save_tiny_chat_llama(Path(directory))
        model_id = model_path.name
        with (
            running_swarm(model_path, "0:4") as (dht, (server,)),
            start_api(model_path, dht.initial_peers) as api,
        ):
            client = WireClient(dht.initial_peers)
            probes = _APIProbes(api.url, model_id, random.Random(seed))
            try:
                initial_cache = client.info(server.peer_id)["cache_tokens_available"]
                probes.http.post("/v1/completions", json={"model": model_id, **VALID_COMPLETION})  # warm up
                rss_before = psutil.Process(api.pid).memory_info().rss
                kinds = [probes.malformed_http] * 6 + [probes.malformed_websocket, probes.valid, probes.valid,
                         probes.leaving_stream, probes.leaving_websocket]  # fmt: skip
                started = time.perf_counter()
                for _ in range(count):
                    probes.rng.choice(kinds)()
                    if api.process.poll() is not None:
                        break
                seconds = time.perf_counter() - started
                alive = api.process.poll() is None
                report = {
                    "requests": count,
                    "seconds": round(seconds, 1),
                    "outcomes": dict(sorted(probes.outcomes.items())),
                    "valid_p50_seconds": round(float(np.percentile(probes.valid_seconds, 50)), 3),
                    "valid_p95_seconds": round(float(np.percentile(probes.valid_seconds, 95)), 3),
                    "api_crashed": not alive,
                    "places_left_held": probes.gauge("petals_api_requests_in_progress") if alive else None,
                    "websocket_sessions_left_open": probes.gauge("petals_api_websocket_sessions") if alive else None,
                    "leaked_cache_tokens": initial_cache - _settled_cache(client, server.peer_id, initial_cache),
                    "api_rss_before_mib": round(rss_before / 2**20, 1),
                    "api_rss_after_mib": round(psutil.Process(api.pid).memory_info().rss / 2**20, 1) if alive else None,
                    "long_prompt_characters": long_prompt,
                    **probes.models_latency_during_long_prompts(long_prompt),
                }  # fmt: skip
                if stall:
                    report["stall"] = run_api_stall(probes, server, model_id)
            finally:
                probes.http.close()
                client.close()
    return report


def run_api_stall(probes: _APIProbes, server, model_id: str, streams: int = 32, stall: float = 8.0) -> dict:
    """The only server stopped for ``stall`` seconds while ``streams`` streams generate."""
    import threading

    ended: list[str] = []
    first_events = threading.Semaphore(0)

    def stream(index: int) -> None:
        body = {
            "model": model_id,
            "prompt": f"Story {index}:",
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
        }
        how, told = "unfinished", False
        try:
            with probes.http.stream("POST", "/v1/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if not told and line.startswith("data: "):
                        told = True
                        first_events.release()
                    if line == "data: [DONE]":
                        how = "tokens to the end"
                    elif line.startswith("data: ") and '"error"' in line:
                        how = "an error event"
        except Exception as error:  # counted: a stream must not break
            how = f"broken ({type(error).__name__})"
        finally:
            if not told:
                first_events.release()
            ended.append(how)

    threads = [threading.Thread(target=stream, args=(index,), daemon=True) for index in range(streams)]
    for thread in threads:
        thread.start()
    for _ in threads:
        first_events.acquire(timeout=120)
    server.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(stall)
    finally:
        server.process.send_signal(signal.SIGCONT)
    returned, answer_seconds = time.monotonic(), None
    while answer_seconds is None and time.monotonic() - returned < 60:
        with contextlib.suppress(Exception):
            if (
                probes.http.post(
                    "/v1/completions", json={"model": model_id, **VALID_COMPLETION}, timeout=30
                ).status_code
                == 200
            ):
                answer_seconds = time.monotonic() - returned
    for thread in threads:
        thread.join(300)
    return {
        "streams": streams,
        "stall_seconds": stall,
        "ended": dict(Counter(ended)),
        "new_answer_seconds_after_return": None if answer_seconds is None else round(answer_seconds, 2),
    }


# ---- the report ---------------------------------------------------------------------------------


def checks(report: dict) -> list[tuple[str, bool]]:
    malformed, clients, faults = report["malformed"], report["concurrent_clients"], report["faults"]
    return [
        ("no server crash", not malformed["server_crashed"]),
        ("server still serves and is listed", malformed["server_still_serves"] and malformed["dht_still_lists_the_server"]),
        ("no leaked KV cache", malformed["leaked_cache_tokens"] == 0),
        ("no malformed DHT record stored", "dht: malformed record STORED" not in malformed["outcomes"]),
        ("no client errors", clients["errors"] == 0),
        ("every client output equals local", clients["outputs_equal_local"] == clients["clients"]),
        *((f"{name}: recovered within 10 s with equal output",
           fault["output_equals_local"] and fault["recovery_seconds"] is not None and fault["recovery_seconds"] < 10)
          for name, fault in faults.items()),
        *trust_checks(report["trust"]),
        *api_checks(report["api"]),
    ]  # fmt: skip


def api_checks(api: dict) -> list[tuple[str, bool]]:
    outcomes = api["outcomes"]
    bad = [name for name in outcomes if "BAD" in name or "FAILED" in name]
    checks = [
        ("API: every malformed request a 4xx in OpenAI's shape, no traceback or path", not bad),
        ("API: every valid request served", any(name.startswith("valid") for name in outcomes)),
        ("API: process up, no generation place or WebSocket session left held",
         not api["api_crashed"] and api["places_left_held"] == 0 and api["websocket_sessions_left_open"] == 0),
        ("API: no leaked KV cache", api["leaked_cache_tokens"] == 0),
    ]  # fmt: skip
    if "stall" in api:
        stall = api["stall"]
        every_stream_ended = sum(
            stall["ended"].get(how, 0) for how in ("tokens to the end", "an error event")
        )
        checks.append(
            ("API: the only server stopped 8 s during 32 streams: every stream ended, a new answer within 30 s",
             every_stream_ended == stall["streams"] and (stall["new_answer_seconds_after_return"] or 99) <= 30)
        )  # fmt: skip
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--short", action="store_true", help="the CI version: fewer requests and clients, no fault cases"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    requests, dht_values, clients, tokens = (300, 40, 3, 8) if args.short else (1200, 200, 16, 64)
    with tempfile.TemporaryDirectory() as directory:
        model_path = save_tiny_llama(Path(directory))
        report = {
            "seed": args.seed,
            "short": args.short,
            "malformed": run_malformed(model_path, args.seed, requests, dht_values),
            "concurrent_clients": run_concurrent_clients(model_path, clients, tokens),
            # the short (CI) version leaves faults to tests/test_client_faults.py, which CI runs too
            "faults": {} if args.short else run_faults(model_path, 32),
            "trust": run_trust(model_path, args.seed, 8 if args.short else 32, PREFIX),
            "api": run_api_probes(
                args.seed,
                200 if args.short else 1000,
                250_000 if args.short else 1_000_000,
                stall=not args.short,
            ),
        }
    report["checks"] = [{"check": name, "met": met} for name, met in checks(report)]
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    failed = [item["check"] for item in report["checks"] if not item["met"]]
    print("reliability: " + ("all checks met" if not failed else "FAILED: " + "; ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
