"""Every patch of a third-party library lives in ``petals.patches``, checks the shape of what it changes
and is left out, in one debug line, where that differs; each patch's test shows what it prevents, by
the failure it prevents reproduced without it (``WHAT_EACH_PATCH_PREVENTS``); and the per-server message
limit leaves other peers' and client streams alone."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import logging
import subprocess
import sys
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from hivemind.p2p import P2P, P2PContext, P2PHandlerError
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.serializer import MSGPackSerializer

from petals import patches
from petals.bounded_msgpack import MsgpackLimitError
from petals.cli.errors import explain
from petals.network.p2p import LOOPBACK_MADDRS, NetworkOptions, leave_network
from petals.testing.malformed import nested_tuples

ROOT = Path(__file__).resolve().parent.parent
PATCHES_MODULE = ROOT / "core" / "petals" / "patches.py"
SOURCES = sorted(
    path
    for pattern in ("core/petals/**/*.py", "petals_*/petals_*/**/*.py", "plugins/*/petals_*/**/*.py")
    for path in ROOT.glob(pattern)
)


ALL_PATCHES = (
    *patches.PATCHES,
    *(import_patch.patch for import_patch in patches.IMPORT_PATCHES),
    patches.TORCH_DISTRIBUTED_UNUSED,
    patches.GGUF_PARSED_ONCE,
    patches.GGUF_METADATA_IN_BULK,
    patches.GGUF_VALUES_SOONER,
)


def test_every_patch_declares_what_it_replaces_where_it_was_checked_and_fits_the_installed_code():
    assert [patch.target for patch in patches.PATCHES] == [
        "hivemind.utils.serializer:MSGPackSerializer.loads",
        "asyncio.subprocess:create_subprocess_exec",
        "hivemind.p2p:P2P.add_binary_stream_handler (of one P2P instance)",
        "hivemind.p2p:P2P.send_protobuf, hivemind.p2p.p2p_daemon_bindings.control:write_pbmsg",
    ]
    patches.apply_patches()  # what petals installed in their place keeps the shape too
    for patch in ALL_PATCHES:
        assert patch.reason and patch.checked_on
        assert all(len(release.split()) >= 2 for release in patch.checked_on)  # "distribution version"
        # both ends of the ranges (make test, make test-oldest) have the shapes the patches were written for
        assert patch.shape() is None, f"{patch.target}: {patch.shape()}"


def test_a_patch_whose_target_has_another_shape_is_left_out_in_one_debug_line_and_the_rest_applies(caplog):
    installed = []
    odd = patches.Patch(
        "hivemind.p2p:P2P.something",
        ("hivemind 0.0.1",),
        "a test",
        shape=lambda: "P2P.something is '(a, b)', not '(a)'",
        install=lambda: installed.append(1),
    )
    with caplog.at_level(logging.DEBUG, logger="petals.patches"):
        patches.apply_patches([patches.BOUNDED_MSGPACK, odd])
        patches.apply_patches([odd])  # checked once
    assert installed == []
    assert [record.getMessage() for record in caplog.records if record.name == "petals.patches"] == [
        "Leaving hivemind.p2p:P2P.something unchanged (checked on hivemind 0.0.1): "
        "P2P.something is '(a, b)', not '(a)'"
    ]
    with pytest.raises(MsgpackLimitError):  # the one that fits is applied
        MSGPackSerializer.loads(nested_tuples(200))


def test_patches_are_applied_once():
    patches.apply_patches()
    loads = MSGPackSerializer.loads
    patches.apply_patches()
    assert MSGPackSerializer.loads is loads
    with pytest.raises(MsgpackLimitError):  # checked before the C decoder would overflow its stack
        MSGPackSerializer.loads(nested_tuples(200))


def test_a_shape_that_cannot_be_read_is_a_shape_that_differs(caplog):
    def gone() -> str | None:
        from hivemind.p2p import NoSuchThing  # noqa: F401

    with caplog.at_level(logging.DEBUG, logger="petals.patches"):
        assert not patches.Patch("hivemind.p2p:NoSuchThing", ("hivemind 0.0.1",), "a test", gone).fits()
    assert "ImportError: cannot import name 'NoSuchThing'" in caplog.text


@pytest.mark.parametrize(
    "patch, where, changed, differs",
    [
        (
            patches.BOUNDED_MSGPACK,
            "hivemind.utils.serializer:MSGPackSerializer.loads",
            staticmethod(lambda buf, strict=True: None),
            "MSGPackSerializer.loads is '(buf, strict=True)', not '(buf)'",
        ),
        (
            patches.WHOLE_MESSAGES,
            "hivemind.p2p:P2P.HEADER_LEN",
            4,
            "P2P.HEADER_LEN is 4, not 8",
        ),
        (
            patches.INBOUND_MESSAGE_LIMIT,
            "hivemind.p2p:P2P.add_binary_stream_handler",
            lambda self, name, handler: None,
            "P2P.add_binary_stream_handler is '(self, name, handler)', not '(self, name, handler, balanced=False)'",
        ),
        (
            patches.TORCH_DISTRIBUTED_UNUSED,
            "transformers.utils.import_utils:is_torch_distributed_available",
            lambda check_device=False: True,
            "is_torch_distributed_available is '(check_device=False)', not '()'",
        ),
        (
            patches.GGUF_PARSED_ONCE,
            "gguf:get_tensor_name_map",
            lambda arch: None,
            "get_tensor_name_map is '(arch)', not '(arch, n_blocks)'",
        ),
        (
            patches.GGUF_METADATA_IN_BULK,
            "gguf.gguf_reader:GGUFReader._get_field_parts",
            lambda self, offset: None,
            "GGUFReader._get_field_parts is '(self, offset)', not '(self, orig_offs, raw_type)'",
        ),
        (
            patches.GGUF_VALUES_SOONER,
            "transformers.integrations.ggml:_gguf_parse_value",
            lambda value: None,
            "ggml._gguf_parse_value is '(value)', not '(_value, data_type)'",
        ),
    ],
)
def test_a_patch_sees_a_changed_signature_or_attribute(monkeypatch, patch, where, changed, differs):
    module, _, name = where.partition(":")
    owner = importlib.import_module(module)
    if "." in name:
        owner, name = getattr(owner, name.split(".")[0]), name.split(".")[1]
    monkeypatch.setattr(owner, name, changed)
    assert differs in patch.shape()
    assert not patch.fits()


def test_an_import_patch_reads_its_package_from_its_files(tmp_path, monkeypatch):
    """The lazy hivemind packages compare the ``__init__``'s imports with their export table, which
    changes with the package; torch._dynamo's the signatures of the marks transformers makes."""
    monkeypatch.setitem(patches._HIVEMIND_EXPORTS, "hivemind.dht", {"DHT": "hivemind.dht.dht"})
    differs = patches.LAZY_HIVEMIND_DHT.patch.shape()
    assert differs.startswith("its __init__ imports differ in [('DHTID', 'hivemind.dht.routing')")
    monkeypatch.setitem(patches._DYNAMO_MARKS, "disable", "(fn=None, recursive=True)")
    assert "decorators.disable is '(fn=None, recursive=True, *, reason=None, wrapping=True)', not" in (
        patches.LAZY_DYNAMO.patch.shape()
    )


class RecordingWriter:
    """What a ``StreamWriter`` is asked to write, call by call."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        pass


@pytest.mark.parametrize("size", [0, 1, 200, 2**16 - 9, 2**16 - 8, 2**16, 3 * 2**16 + 5])
def test_a_stream_message_is_written_whole_and_reads_back_the_same(size):
    patches.apply_patches()
    message = runtime_pb2.ExpertResponse(metadata=b"m" * size)
    body = message.SerializeToString()
    for sent, marker in ((message, P2P.MESSAGE_MARKER), (RPCError(message="no" * size), P2P.ERROR_MARKER)):
        writer = RecordingWriter()
        asyncio.run(P2P.send_protobuf(sent, writer))
        wire = b"".join(writer.writes)
        body = sent.SerializeToString()
        assert wire == marker + len(body).to_bytes(8, "big") + body  # hivemind's framing, byte for byte
        assert len(writer.writes) == max(1, -(-len(body) // 2**16))  # one write per 64 KiB chunk

        async def read_back(wire: bytes) -> tuple:
            reader = asyncio.StreamReader()
            reader.feed_data(wire)
            return await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)

        response, error = asyncio.run(read_back(wire))
        assert (response, error) == ((message, None) if sent is message else (None, sent))


HIVEMINDS_OWN_WRITES = """
import asyncio
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.p2p.p2p_daemon_bindings import control

class Writer:
    writes = 0
    def write(self, data):
        Writer.writes += 1
    async def drain(self):
        pass

asyncio.run(P2P.send_protobuf(runtime_pb2.ExpertResponse(metadata=b"m" * 200), Writer()))
stream = Writer.writes
Writer.writes = 0
asyncio.run(control.write_pbmsg(Writer(), runtime_pb2.ExpertRequest(metadata=b"u" * 300)))
print(stream, Writer.writes)
"""


def test_without_it_hivemind_writes_one_message_in_several_writes():
    """What ``WHOLE_MESSAGES`` prevents: a stream message in three writes (marker, length, body) and a
    unary message's 2-byte length byte by byte, each a system call p2pd may forward as a frame of its own."""
    assert run_python(HIVEMINDS_OWN_WRITES).split() == ["3", "3"]


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_383, 16_384, 2**21 + 5])
def test_a_daemon_message_is_written_whole_with_the_same_bytes(size):
    from hivemind.p2p.p2p_daemon_bindings import control, utils

    patches.apply_patches()
    message = runtime_pb2.ExpertRequest(metadata=b"u" * size)
    ours, hiveminds = RecordingWriter(), RecordingWriter()
    asyncio.run(control.write_pbmsg(ours, message))
    asyncio.run(utils.write_pbmsg(hiveminds, message))  # hivemind's own, still defined there
    assert b"".join(ours.writes) == b"".join(hiveminds.writes)
    assert len(ours.writes) == 1 < len(hiveminds.writes)  # hivemind: each varint byte, then the body


# ---- import patches ------------------------------------------------------------------------------

HIVEMIND_IMPORTS = """
import sys
{before}
import hivemind.dht, hivemind.p2p
unused = sorted(name for name in ("hivemind.averaging", "hivemind.moe", "hivemind.optim") if name in sys.modules)
import hivemind
from hivemind import DHT, Optimizer
print(unused, hivemind.__version__, DHT.__module__, Optimizer.__module__, sorted(getattr(hivemind, "__all__", [])) == sorted(
    ["DecentralizedAverager", "DHT", "ModuleBackend", "RemoteExpert", "RemoteMixtureOfExperts",
     "RemoteSwitchMixtureOfExperts", "Server", "register_expert_class", "GradScaler", "Optimizer",
     "TrainingAverager"]))
try:
    hivemind.NoSuchName
except AttributeError as error:
    print(error)
"""


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_after_import_petals_hivemind_imports_only_the_subpackages_used_and_its_names_on_access():
    version = importlib.metadata.version("hivemind")
    lines = run_python(HIVEMIND_IMPORTS.format(before="import petals")).splitlines()
    assert lines == [
        f"[] {version} hivemind.dht.dht hivemind.optim.optimizer True",
        "module 'hivemind' has no attribute 'NoSuchName'",
    ]
    # without petals, hivemind's own __init__ imports every subpackage
    lines = run_python(HIVEMIND_IMPORTS.format(before="")).splitlines()
    assert lines[0].startswith("['hivemind.averaging', 'hivemind.moe', 'hivemind.optim']")


LOGGER_IMPORTS = """
import sys
{before}
from hivemind.utils.logging import get_logger
from hivemind.dht.routing import DHTID
print("torch" in sys.modules)
"""


def test_without_them_a_logger_or_a_dht_id_of_hivemind_imports_torch():
    """What ``LAZY_HIVEMIND_UTILS`` and ``LAZY_HIVEMIND_DHT`` prevent: a peer that holds no blocks
    (``petals dht``, ``monitor``, ``health``) importing torch through hivemind's package ``__init__``s."""
    assert run_python(LOGGER_IMPORTS.format(before="")).split() == ["True"]
    assert run_python(LOGGER_IMPORTS.format(before="import petals")).split() == ["False"]


@pytest.mark.parametrize("package", ["hivemind", "hivemind.dht", "hivemind.utils"])
def test_a_lazy_hivemind_package_exports_what_its_init_imports_and_the_same_objects(package):
    """The export tables are read off the installed ``__init__`` files, and each name is the object the
    ``__init__`` would have bound; a submodule is an attribute on first access, as after the ``__init__``."""
    init = patches.parse_source(Path(importlib.util.find_spec(package).origin).read_text())
    imports = {
        alias.asname or alias.name: node.module
        for node in init.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert patches._HIVEMIND_EXPORTS[package] == imports
    if package != "hivemind":  # its subpackages import scipy, moe and more: the test above covers it
        module = importlib.import_module(package)
        for name, source in imports.items():
            assert getattr(module, name) is getattr(importlib.import_module(source), name)
    submodule = {"hivemind": "p2p", "hivemind.dht": "routing", "hivemind.utils": "nested"}[package]
    assert getattr(importlib.import_module(package), submodule).__name__ == f"{package}.{submodule}"
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'no_such_name'"):
        _ = importlib.import_module(package).no_such_name


def test_an_import_patch_of_another_shape_leaves_the_import_alone():
    code = HIVEMIND_IMPORTS.format(
        before="from petals import patches\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_ImportPatchFinder']\n"
        "odd = patches.Patch('hivemind:__init__', ('hivemind 0.0.1',), 'a test', lambda: 'its __init__ differs')\n"
        "patches.install_import_patches([patches.ImportPatch('hivemind', odd, patches.LAZY_HIVEMIND.exec_module)])"
    )
    assert run_python(code).startswith("['hivemind.averaging', 'hivemind.moe', 'hivemind.optim']")


def test_every_import_patch_declares_its_module():
    assert [patch.module for patch in patches.IMPORT_PATCHES] == [
        "hivemind",
        "hivemind.dht",
        "hivemind.utils",
        "torch._dynamo",
        "scipy.optimize",
    ]


COMPILER_MARKS = """
import sys
{before}
import torch
import transformers.masking_utils
from transformers.modeling_utils import PreTrainedModel
from scipy.optimize import linear_sum_assignment

print("torch._dynamo.convert_frame" in sys.modules, "scipy.optimize._optimize" in sys.modules)
from torch._dynamo import disable as kept_disable  # with petals: a stand-in, used once dynamo has loaded

@torch.compiler.disable
def eager_only(x):
    return x + 1

@torch.compiler.disable(recursive=False)
def eager_top(x):
    return x * 3

def compiled(x):
    return eager_top(eager_only(x * 2)) - 1

explained = torch._dynamo.explain(compiled)(torch.ones(2))
allowed = torch._dynamo.trace_rules.is_callable_allowed(PreTrainedModel.can_record_outputs.fget)
print(explained.graph_count, explained.graph_break_count, compiled(torch.ones(2)).tolist(), allowed)
late = kept_disable(lambda x: x + 1)
explained = torch._dynamo.explain(lambda x: late(x * 2) - 1)(torch.ones(2))
print(explained.graph_count, explained.graph_break_count)
import scipy.optimize
same = linear_sum_assignment is scipy.optimize.linear_sum_assignment
print(linear_sum_assignment([[3, 1], [1, 3]])[1].tolist(), scipy.optimize.minimize.__module__, same)
"""


def test_transformers_imports_neither_the_compiler_nor_scipy_optimize_and_compiles_the_same_when_asked():
    deferred, eager = (
        run_python(COMPILER_MARKS.format(before="import petals")),
        run_python(COMPILER_MARKS.format(before="")),
    )
    assert deferred.splitlines()[0] == "False False"
    assert eager.splitlines()[0] == "True True"
    # once something compiles, the marks transformers made at import act as if made then
    assert (
        deferred.splitlines()[1:]
        == eager.splitlines()[1:]
        == ["2 1 [8.0, 8.0] True", "2 1", "[1, 0] scipy.optimize._minimize True"]
    )


SUBMODULES_FIRST = """
import sys
{before}
import torch
import transformers.masking_utils
import torch._dynamo.convert_frame as convert_frame
import scipy.optimize._minimize as minimize
import scipy.optimize
print(
    convert_frame is torch._dynamo.convert_frame,
    convert_frame.GraphRuntimeEnv is torch._dynamo.aot_compile.GraphRuntimeEnv,  # executed once
    convert_frame.__spec__.name,
    torch._dynamo.disable.__module__,
    minimize.minimize is scipy.optimize.minimize,
)
"""


def test_importing_a_submodule_of_a_deferred_package_runs_the_package_first_as_python_does():
    expected = "True True torch._dynamo.convert_frame torch._dynamo.decorators True"
    assert run_python(SUBMODULES_FIRST.format(before="import petals")).strip() == expected
    assert run_python(SUBMODULES_FIRST.format(before="")).strip() == expected


THREADS_AT_ONCE = """
import threading
import petals, torch, transformers.masking_utils
results = []

def submodule():
    import torch._dynamo.eval_frame as eval_frame
    results.append(eval_frame is torch._dynamo.eval_frame)

def name():
    results.append(torch._dynamo.is_compiling.__module__)

threads = [threading.Thread(target=target) for target in (submodule, name, submodule, name)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(60)
print(sorted(map(str, results)), any(thread.is_alive() for thread in threads))
"""


def test_threads_that_load_a_deferred_package_at_once_all_get_it_loaded_once():
    lines = subprocess.run(
        [sys.executable, "-c", THREADS_AT_ONCE], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert lines == ["['True', 'True', 'torch._dynamo.external_utils', 'torch._dynamo.external_utils'] False"]


# ---- nothing else assigns into a third-party module or class -----------------------------------


def assignments_into_third_party_code(source: str) -> list[str]:
    """Attribute assignments (``=``, ``+=``, ``del``, ``setattr``/``delattr``) whose target is reached
    from a name this module imported from a package other than petals."""
    tree = patches.parse_source(source)
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(alias.asname or alias.name).split(".")[0]: alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported |= {alias.asname or alias.name: node.module for alias in node.names}
    third_party = {name for name, module in imported.items() if module.split(".")[0] != "petals"}
    third_party |= _aliases_of(tree, third_party)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"setattr", "delattr"}
        ):
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Attribute) and _root_name(target) in third_party:
                found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def _aliases_of(tree: ast.AST, names: set[str]) -> set[str]:
    """Names bound to one of ``names`` or an attribute of it (``cls = hivemind.p2p.P2P``, ``cls =
    getattr(p2p, "P2P")``), transitively; a call's result (an instance) is not an alias."""
    aliases: set[str] = set()
    while True:
        known = names | aliases
        new = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and _alias_root(node.value) in known
            for target in node.targets
            if isinstance(target, ast.Name)
        } - known
        if not new:
            return aliases
        aliases |= new


def _alias_root(node: ast.expr) -> str | None:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and node.args
    ):
        node = node.args[0]
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_module_but_petals_patches_assigns_into_a_third_party_module_or_class():
    assert len(SOURCES) > 50 and PATCHES_MODULE in SOURCES
    found = {
        str(path.relative_to(ROOT)): assignments
        for path in SOURCES
        if path != PATCHES_MODULE and (assignments := assignments_into_third_party_code(path.read_text()))
    }
    assert found == {}, "patch third-party code in petals/patches.py only, with its version check"


def test_the_check_finds_patches_and_leaves_our_own_objects_alone():
    patching = """
import asyncio.subprocess
import torch.nn as nn
from hivemind.utils.serializer import MSGPackSerializer
from hivemind import p2p
nn.Module.register_parameter = lambda *args: None
MSGPackSerializer.loads = staticmethod(len)
asyncio.subprocess.create_subprocess_exec = None
setattr(p2p.P2P, "receive_raw_data", None)
del nn.Linear.forward
serializer = MSGPackSerializer
serializer.dumps = None
P2P = getattr(p2p, "P2P")
same = P2P
same.create = None
"""
    assert len(assignments_into_third_party_code(patching)) == 7
    ours = """
import os
import torch
from petals import wire
from petals.config import LazyClass
os.environ["PETALS_LOG_LEVEL"] = "DEBUG"
module = torch.nn.Linear(1, 1)
module.weight = None
setattr(module, "bias", None)
wire.MAX_STREAM_PART_BYTES = 1
LazyClass.path = "x"
"""
    assert assignments_into_third_party_code(ours) == []
    assert (
        len(assignments_into_third_party_code(PATCHES_MODULE.read_text())) >= 2
    )  # it does find the real ones


P2PD_SESSIONS = """
import asyncio, os
from hivemind.p2p import P2P
from petals.network.p2p import LOOPBACK_MADDRS, NetworkOptions, leave_network

async def main():
    options = dict(host_maddrs=LOOPBACK_MADDRS, nat_port_map=False, auto_nat=False, use_relay=False)
    plain = await P2P.create(**options)  # hivemind's own start, before petals patches anything
    try:
        ours = await NetworkOptions(**options).create_p2p()
        try:
            print(os.getsid(plain._child.pid) == os.getsid(0), os.getsid(ours._child.pid) == os.getsid(0))
        finally:
            await leave_network(ours, None)
    finally:
        await plain.shutdown()

asyncio.run(main())
"""


def test_without_p2pd_apart_p2pd_shares_our_session_and_so_our_signals():
    """What ``P2PD_APART`` prevents: hivemind starts p2pd in our session and process group, so that
    Ctrl-C or systemd's group signal stops the daemon before the server can announce OFFLINE through
    it (tests/test_server_signals.py has the whole story)."""
    result = subprocess.run(
        [sys.executable, "-c", P2PD_SESSIONS], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.split() == ["True", "False"], result.stderr


# ---- the message-size limit belongs to one server's P2P -----------------------------------------

LIMIT = 10_000
LOOPBACK = {"host_maddrs": LOOPBACK_MADDRS, "nat_port_map": False, "auto_nat": False, "use_relay": False}


async def echo(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    async for request in requests:
        yield runtime_pb2.ExpertResponse(metadata=request.metadata)


def echo_request(size: int) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=b"x" * size)


async def call_echo(p2p, peer_id, size: int) -> int:
    """Send ``size`` bytes to ``peer_id``'s echo handler on a stream; the length of the echo."""
    responses = await p2p.iterate_protobuf_handler(
        peer_id, "echo", as_aiter(echo_request(size)), runtime_pb2.ExpertResponse
    )
    return sum([len(response.metadata) async for response in responses])


async def add_echo(p2p) -> None:
    await p2p.add_protobuf_handler(
        "echo", echo, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
    )


def test_a_server_limit_refuses_only_inbound_streams_of_its_own_p2p(caplog):
    async def scenario() -> None:
        server = await NetworkOptions(**LOOPBACK).create_p2p()
        peer = None
        try:
            patches.limit_inbound_message_size(server, LIMIT)
            await add_echo(server)
            maddrs = [str(maddr) for maddr in await server.get_visible_maddrs()]
            peer = await NetworkOptions(initial_peers=maddrs, **LOOPBACK).create_p2p()
            await add_echo(peer)

            assert await call_echo(peer, server.peer_id, LIMIT // 2) == LIMIT // 2
            with caplog.at_level(logging.INFO, logger="petals.patches"):
                try:
                    echoed = await call_echo(peer, server.peer_id, 2 * LIMIT)
                except (P2PHandlerError, ConnectionError):  # the sender may see the stream break instead
                    echoed = 0
            assert echoed == 0  # closed unread, without an answer
            refused = echo_request(2 * LIMIT).ByteSize()
            assert [record.getMessage() for record in caplog.records if record.name == "petals.patches"] == [
                f"Refused a {refused}-byte stream message (this server's limit: {LIMIT} bytes)"
            ]
            assert await call_echo(peer, server.peer_id, LIMIT // 2) == LIMIT // 2  # still serving
            # the streams the server opens as a client, and the other peer's handlers, are not limited:
            # 4 * LIMIT bytes go to the peer and come back
            assert await call_echo(server, peer.peer_id, 4 * LIMIT) == 4 * LIMIT
        finally:
            for p2p in (peer, server):
                if p2p is not None:
                    await leave_network(p2p, None)

    asyncio.run(scenario())


REFUSED = runtime_pb2.ExpertRequest(metadata=b"refuse me")


async def refuse_some(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """Echoes each request, and fails on one that asks for it."""
    async for request in requests:
        if request.metadata.startswith(b"refuse"):
            raise ValueError("refused")
        yield runtime_pb2.ExpertResponse(metadata=request.metadata)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the other end closes the stream within ``seconds`` (nothing more may arrive)."""
    try:
        async with asyncio.timeout(seconds):
            assert await reader.read() == b""
        return True
    except TimeoutError:
        return False


def test_a_failed_stream_closes_after_its_caller_so_that_its_error_arrives(monkeypatch):
    """p2pd resets a stream whose handler closes it, and the reset can overtake the error still on its
    way (the CI saw ``rpc_inference`` answer a refused request with nothing). After an error the
    server's end stays open until the caller closes its own, or for ``CALLER_CLOSE_GRACE`` seconds."""

    async def open_and_send(p2p, peer_id) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, "refuse_some")
        await P2P.send_protobuf(REFUSED, writer)  # no end-of-stream: the caller stays
        return reader, writer

    async def scenario() -> None:
        server = await NetworkOptions(**LOOPBACK).create_p2p()
        peer = None
        try:
            patches.limit_inbound_message_size(server, 2**20)
            await server.add_protobuf_handler(
                "refuse_some", refuse_some, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
            )
            maddrs = [str(maddr) for maddr in await server.get_visible_maddrs()]
            peer = await NetworkOptions(initial_peers=maddrs, **LOOPBACK).create_p2p()

            reader, writer = await open_and_send(peer, server.peer_id)
            response, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
            assert response is None and error.message == "refused"
            assert not await closed_within(reader, 0.3)  # the server waits for us (it closed at once before)
            await P2P.send_protobuf(echo_request(12), writer)  # what still comes is dropped
            assert not await closed_within(reader, 0.2)
            writer.close()

            # a caller that stays: the server closes after the grace
            monkeypatch.setattr(patches, "CALLER_CLOSE_GRACE", 0.5)
            reader, writer = await open_and_send(peer, server.peer_id)
            assert (await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader))[1].message == "refused"
            assert await closed_within(reader, 10.0)
            writer.close()

            # a stream that succeeds closes as soon as its handler is done, as hivemind closes it, even
            # when a chunk of its answer is the error marker's byte alone: a body of 65,537 bytes
            # (hivemind writes 64 KiB chunks) that ends with it
            monkeypatch.setattr(patches, "CALLER_CLOSE_GRACE", 60.0)
            tricky = runtime_pb2.ExpertRequest(metadata=b"x" * 65_532 + P2P.ERROR_MARKER)
            assert len(runtime_pb2.ExpertResponse(metadata=tricky.metadata).SerializeToString()) == 65_537
            for request in (echo_request(10), tricky):
                responses = await peer.iterate_protobuf_handler(
                    server.peer_id, "refuse_some", as_aiter(request), runtime_pb2.ExpertResponse
                )
                async with asyncio.timeout(30):  # not the 60 s grace
                    echoed = [response.metadata async for response in responses]
                assert echoed == [request.metadata]
            # and hivemind's client still sees the error of a failed one
            with pytest.raises(P2PHandlerError, match="refused"):
                responses = await peer.iterate_protobuf_handler(
                    server.peer_id, "refuse_some", as_aiter(REFUSED), runtime_pb2.ExpertResponse
                )
                [response async for response in responses]
        finally:
            for p2p in (peer, server):
                if p2p is not None:
                    await leave_network(p2p, None)

    asyncio.run(scenario())


def test_a_failed_p2pd_is_explained_by_its_reason_even_when_a_log_line_came_after_it():
    """p2pd may write a JSON log line from another goroutine after its fatal line; hivemind's error
    quotes only the very last line, so ``create_p2p`` looks back for the reason (CI saw this race)."""
    fatal = "2026/12/03 04:22:37 failed to connect to bootstrap peers"
    output = [
        '{"level":"info","logger":"dht","msg":"starting"}',
        fatal,
        '{"level":"info","logger":"dht/RtRefreshManager","msg":"starting refreshing cpl 0"}',
    ]

    async def read_all() -> list[str]:
        reader = asyncio.StreamReader()
        reader.feed_data("".join(line + "\n" for line in output).encode())
        reader.feed_eof()
        recorder = patches._LastLines(reader)
        seen = []
        while line := await recorder.readline():  # as hivemind's P2P._read_outputs reads it
            seen.append(line.rstrip().decode())
        return seen, patches.p2pd_exit_reason(types.SimpleNamespace(stdout=recorder))

    seen, reason = asyncio.run(read_all())
    assert seen == output  # hivemind reads every line unchanged
    assert reason == fatal
    assert "cannot reach any of the --initial_peers" in explain(
        P2PDaemonError(f"Daemon failed to start: {reason}")
    )
    assert patches.p2pd_exit_reason(types.SimpleNamespace(stdout=None)) is None  # not started by petals


# ---- a server's view of torch.distributed --------------------------------------------------------

# what transformers' loading code imports for process groups (test_server_imports checks a server)
UNUSED_BY_A_SERVER = ("sympy", "torch.distributed.tensor", "torch.distributed.fsdp")


AFTER_LOADING_CODE = """
import sys
import petals
from petals.patches import without_torch_distributed
{before}
without_torch_distributed()
import transformers.core_model_loading, transformers.modeling_utils
from transformers.utils import is_torch_distributed_available
print(is_torch_distributed_available(), *(name in sys.modules for name in {unused}))
"""


def test_transformers_sees_torch_distributed_as_before_where_its_loading_code_came_first():
    """Also what ``TORCH_DISTRIBUTED_UNUSED`` prevents: without it, loading code imports sympy, DTensor
    and FSDP."""
    unused = UNUSED_BY_A_SERVER
    assert run_python(AFTER_LOADING_CODE.format(before="", unused=unused)).split() == ["False"] * 4
    unpatched = AFTER_LOADING_CODE.replace("without_torch_distributed()\n", "")
    assert run_python(unpatched.format(before="", unused=unused)).split() == ["True"] * 4
    before = "import transformers.core_model_loading"  # its module-level imports ran already: nothing changes
    assert run_python(AFTER_LOADING_CODE.format(before=before, unused=unused)).split() == ["True"] * 4


# ---- the demo model's conversion from GGUF -------------------------------------------------------


def test_without_gguf_parsed_once_transformers_parses_a_file_per_use(tmp_path, monkeypatch):
    """What ``GGUF_PARSED_ONCE`` prevents: transformers parsing a GGUF file anew each time it reads from
    it (the demo model's conversion asks three times, about 5 s each on two cores)."""
    import gguf
    import numpy as np
    from transformers import AutoConfig

    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):  # gguf's own signature, which the patch checks
            parsed.append(path)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    for within in (contextlib.nullcontext, patches.gguf_parsed_once):
        parsed.clear()
        with within():
            for _ in range(2):
                assert AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf").num_hidden_layers == 1
        assert len(parsed) == (2 if within is contextlib.nullcontext else 1)


@pytest.fixture(scope="module")
def vocabulary_gguf(tmp_path_factory) -> Path:
    """A GGUF file with a tokenizer's metadata (3000 tokens, their scores and types, merges), arrays of
    other kinds (unsigned bytes, 64-bit floats) and a few tensors."""
    import gguf
    import numpy as np

    path = tmp_path_factory.mktemp("gguf") / "vocabulary.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    tokens = [f"tok{index}" if index % 7 else f"\u2581\u00e9t\u00e9 {index}" for index in range(3000)]
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(index) / 3 for index in range(3000)])
    writer.add_token_types([index % 6 + 1 for index in range(3000)])
    writer.add_token_merges([f"t o{index}" for index in range(500)])
    writer.add_key_value("test.bytes", [1, 2, 255], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8)
    writer.add_key_value("test.doubles", [0.5, -2.25], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT64)
    writer.add_bool("test.flag", True)
    writer.add_tensor("token_embd.weight", np.arange(3000 * 8, dtype=np.float32).reshape(3000, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def calls_of(function: Callable, run: Callable[[], object]) -> int:
    """How many times ``run()`` calls ``function`` (recursive calls included), counted by the profiler:
    nothing about ``function`` changes."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(run)
    code = function.__code__
    where = (code.co_filename, code.co_firstlineno, code.co_name)
    return sum(stat[1] for key, stat in pstats.Stats(profile).stats.items() if key == where)


def test_petals_gguf_reader_gives_what_gguf_gives_reading_each_array_at_once(vocabulary_gguf):
    """What ``GGUF_METADATA_IN_BULK`` prevents: gguf reading a vocabulary one element at a time, each a
    slice of the file's memory map (a 262k-token vocabulary: 24 s on two cores). The reader petals
    parses files with gives the same fields, parts (values, dtypes, shapes), indices, types and tensors."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader

    plain_reads = calls_of(GGUFReader._get, lambda: GGUFReader(vocabulary_gguf))
    bulk_reads = calls_of(GGUFReader._get, lambda: patches.gguf_reader(vocabulary_gguf))
    assert plain_reads > 4 * 3000 and bulk_reads < 100
    plain, bulk = GGUFReader(vocabulary_gguf), patches.gguf_reader(vocabulary_gguf)
    assert type(bulk) is not GGUFReader and list(bulk.fields) == list(plain.fields)
    for name, field in plain.fields.items():
        ours = bulk.fields[name]
        assert (ours.offset, ours.name, ours.data, ours.types) == (
            field.offset,
            field.name,
            field.data,
            field.types,
        )
        assert len(ours.parts) == len(field.parts), name
        for mine, theirs in zip(ours.parts, field.parts, strict=True):
            assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape) and np.array_equal(
                mine, theirs
            ), name
        assert ours.contents() == field.contents(), name
    assert bulk.fields["tokenizer.ggml.tokens"].contents()[7] == "\u2581\u00e9t\u00e9 7"
    for mine, theirs in zip(bulk.tensors, plain.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.data_offset, mine.n_bytes) == (
            theirs.name,
            theirs.tensor_type,
            theirs.data_offset,
            theirs.n_bytes,
        )
        assert isinstance(mine.data, np.memmap) and np.array_equal(mine.data, theirs.data)


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda data: data[: len(data) - 100], "and its tensor data runs to byte"),
        (lambda data: data[:2000], "and its metadata runs to byte"),
    ],
    ids=["tensor data cut off", "metadata cut off"],
)
def test_a_gguf_file_shorter_than_its_contents_says_so(vocabulary_gguf, tmp_path, damage, says):
    """gguf slices past the end of its memory map without complaint and fails later (a reshape); the
    reader petals parses files with refuses the read, with the file's length."""
    from gguf.gguf_reader import GGUFReader

    cut = tmp_path / "cut.gguf"
    data = vocabulary_gguf.read_bytes()
    cut.write_bytes(damage(data))
    with pytest.raises((ValueError, IndexError)) as plain:  # a reshape, or an index into an empty slice
        GGUFReader(cut)
    assert "bytes long" not in str(plain.value)
    with pytest.raises(ValueError, match=f"it is {len(damage(data))} bytes long, {says}"):
        patches.gguf_reader(cut)


def test_without_gguf_values_sooner_transformers_reads_each_element_in_two_calls(vocabulary_gguf):
    """What ``GGUF_VALUES_SOONER`` prevents: transformers reading each element of every metadata array
    in two calls of its ``_gguf_parse_value``, a string through a list of numpy scalars (Gemma 3's
    vocabulary, scores and token types: 1.2 s on two cores). Within ``gguf_parsed_once`` it reads the
    same values, and calls that function for none of the arrays' elements."""
    from transformers.integrations.ggml import _gguf_parse_value
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    def load() -> dict:
        return load_gguf_checkpoint(str(vocabulary_gguf))

    def load_within() -> dict:
        with patches.gguf_parsed_once(patches.gguf_reader):
            return load()

    assert calls_of(_gguf_parse_value, load) > 2 * (3 * 3000 + 500)
    assert calls_of(_gguf_parse_value, load_within) < 100
    assert load_within() == load()
    assert load()["tokenizer"]["tokens"][7] == "\u2581\u00e9t\u00e9 7"


# ---- each patch shows what it prevents ------------------------------------------------------------

# the test that reproduces, without the patch, the failure it prevents: when it stops failing that way on
# both ends of the ranges, the patch is no longer needed
WHAT_EACH_PATCH_PREVENTS = {
    patches.BOUNDED_MSGPACK.target: "test_bounded_msgpack.py::test_unbounded_decoder_crashes_and_bounded_one_refuses",
    patches.P2PD_APART.target: "test_patches.py::test_without_p2pd_apart_p2pd_shares_our_session_and_so_our_signals",
    patches.INBOUND_MESSAGE_LIMIT.target: "test_patches.py::test_a_server_limit_refuses_only_inbound_streams_of_its_own_p2p",
    patches.WHOLE_MESSAGES.target: "test_patches.py::test_without_it_hivemind_writes_one_message_in_several_writes",
    patches.LAZY_HIVEMIND.patch.target: "test_patches.py::"
    "test_after_import_petals_hivemind_imports_only_the_subpackages_used_and_its_names_on_access",
    patches.LAZY_HIVEMIND_DHT.patch.target: "test_patches.py::"
    "test_without_them_a_logger_or_a_dht_id_of_hivemind_imports_torch",
    patches.LAZY_HIVEMIND_UTILS.patch.target: "test_patches.py::"
    "test_without_them_a_logger_or_a_dht_id_of_hivemind_imports_torch",
    patches.LAZY_DYNAMO.patch.target: "test_patches.py::"
    "test_transformers_imports_neither_the_compiler_nor_scipy_optimize_and_compiles_the_same_when_asked",
    patches.LAZY_SCIPY_OPTIMIZE.patch.target: "test_patches.py::"
    "test_transformers_imports_neither_the_compiler_nor_scipy_optimize_and_compiles_the_same_when_asked",
    patches.TORCH_DISTRIBUTED_UNUSED.target: "test_patches.py::"
    "test_transformers_sees_torch_distributed_as_before_where_its_loading_code_came_first",
    patches.GGUF_PARSED_ONCE.target: "test_patches.py::test_without_gguf_parsed_once_transformers_parses_a_file_per_use",
    patches.GGUF_METADATA_IN_BULK.target: "test_patches.py::"
    "test_petals_gguf_reader_gives_what_gguf_gives_reading_each_array_at_once",
    patches.GGUF_VALUES_SOONER.target: "test_patches.py::"
    "test_without_gguf_values_sooner_transformers_reads_each_element_in_two_calls",
}


def test_every_patch_has_a_test_of_what_it_prevents():
    assert sorted(WHAT_EACH_PATCH_PREVENTS) == sorted(patch.target for patch in ALL_PATCHES)
    for node_id in WHAT_EACH_PATCH_PREVENTS.values():
        file, _, name = node_id.partition("::")
        tree = patches.parse_source((ROOT / "tests" / file).read_text())
        assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, node_id


def test_parse_source_tries_again_after_another_threads_parse_broke_its_own(monkeypatch):
    """CPython 3.11.7's ast shares its depth count between threads (gh-106905); the error is transient."""
    parse, failures = ast.parse, []

    def racing(source, filename="<unknown>"):
        if len(failures) < 2:
            failures.append(filename)
            raise SystemError("AST constructor recursion depth mismatch (before=129, after=142)")
        return parse(source, filename)

    monkeypatch.setattr(ast, "parse", racing)
    assert isinstance(patches.parse_source("x = 1"), ast.Module) and len(failures) == 2
    monkeypatch.setattr(ast, "parse", lambda *args: (_ for _ in ()).throw(SystemError("another error")))
    with pytest.raises(SystemError, match="another error"):
        patches.parse_source("x = 1")
