"""Shared fixtures: tiny random models of every family, saved in the Hugging Face layout; throwaway
plugins that serve a family alone; and the record of which hooks the suite called."""

from __future__ import annotations

import copy
import hashlib
import math
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    BloomConfig,
    FalconConfig,
    Gemma3Config,
    Llama4Config,
    LlamaConfig,
    Mistral3Config,
    MixtralConfig,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    StoppingCriteria,
)

from benchmarks.chat_model import save_tiny_chat_llama
from petals import hookimpl
from petals.plugins import PluginManager, using_plugin_manager
from petals_llama.config import DistributedLlamaConfig

ROOT = Path(__file__).resolve().parent.parent
LAST_TEST = "test_every_hook_is_called_by_some_test"  # in test_hook_docs.py; needs every other test run first
# hooks called in this process, on any plugin manager (the docs meta-test reads it)
CALLED_HOOKS: set[str] = set()
DESELECTED: list[str] = []


def _record_hook_calls(manager: PluginManager) -> None:
    manager.add_hookcall_monitoring(
        before=lambda hook_name, hook_impls, kwargs: CALLED_HOOKS.add(hook_name),
        after=lambda outcome, hook_name, hook_impls, kwargs: None,
    )


_plain_init = PluginManager.__init__


def _recording_init(self: PluginManager, *args, **kwargs) -> None:
    _plain_init(self, *args, **kwargs)
    _record_hook_calls(self)


# every manager records, the process-wide one and those tests create; installed on import, before any exists
PluginManager.__init__ = _recording_init


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.name == LAST_TEST)  # stable: everything else keeps its order


def pytest_deselected(items: list[pytest.Item]) -> None:
    DESELECTED.extend(item.nodeid for item in items)


def missing_from_session(session: pytest.Session) -> list[str]:
    """What of the whole suite this session does not run: tests picked by node id, deselected tests and
    uncollected test files."""
    picked = [arg for arg in session.config.args if "::" in arg]
    collected = {item.path for item in session.items}
    files = [
        *ROOT.glob("tests/test_*.py"),
        *ROOT.glob("petals_*/tests/test_*.py"),
        *ROOT.glob("plugins/*/tests/test_*.py"),
    ]
    return (
        picked + DESELECTED + [str(path.relative_to(ROOT)) for path in sorted(files) if path not in collected]
    )


class LlamaFamilyPlugin:
    """A throwaway plugin serving model type "llama" with ``config_class``; subclasses add the hook under
    test and run with ``serving_only``."""

    config_class: type = DistributedLlamaConfig

    @hookimpl
    def register_model_families(self, register):
        register(self.config_class)


@contextmanager
def serving_only(plugin: object, name: str) -> Iterator[PluginManager]:
    """Installed plugins left out: core's defaults and ``plugin`` alone serve every model type."""
    manager = PluginManager()
    manager.register(plugin, name=name)
    with using_plugin_manager(manager):
        yield manager


TINY_CONFIGS = {
    "llama": LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "bloom": BloomConfig(hidden_size=64, n_layer=4, n_head=4, vocab_size=1000),
    "falcon-new": FalconConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        vocab_size=1000,
        new_decoder_architecture=True,
        parallel_attn=True,
        alibi=False,
        bias=False,
    ),
    "falcon-multi-query": FalconConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        vocab_size=1000,
        new_decoder_architecture=False,
        multi_query=True,
        parallel_attn=True,
        alibi=False,
        bias=False,
    ),
    "falcon-rw": FalconConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        vocab_size=1000,
        new_decoder_architecture=False,
        multi_query=False,
        parallel_attn=False,
        alibi=True,
        bias=True,
    ),
    "mixtral": MixtralConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
    ),
}


def tiny_config(variant: str):
    return copy.deepcopy(TINY_CONFIGS[variant])


def save_tiny_model(variant: str, path: Path, seed: int = 0) -> Path:
    return save_random_model(tiny_config(variant), path, seed)


def save_random_model(
    config,
    path: Path,
    seed: int = 0,
    adjust: Callable[[torch.nn.Module], None] | None = None,
    auto_class: type = AutoModelForCausalLM,
) -> Path:
    """A random float32 causal LM of ``config`` (or another ``auto_class`` model), saved in the Hugging Face
    layout at ``path``; ``adjust`` changes its weights first (one that transformers draws at random, say,
    to a value a test needs)."""
    torch.manual_seed(seed)
    model = auto_class.from_config(config, dtype=torch.float32)
    if adjust is not None:
        adjust(model)
    model.save_pretrained(path)
    return path


def slow_to_forget(model: torch.nn.Module) -> None:
    """A state-space head decays its state by exp(-exp(A_log) dt) a token, and a random model's heads forget
    within a token or two: with A = 0.01 each keeps the session's history, so a state served or restored
    wrong shows in the logits (``adjust`` for ``save_random_model``)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.fill_(math.log(0.01))


# multimodal wrappers (config.json's model_type is the wrapper's, the text model's under text_config) with
# tiny text models of types that plugins serve and tiny vision towers that nothing serves
TINY_TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1000,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
TINY_QWEN3_5_TEXT = dict(
    TINY_TEXT,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
TINY_QWEN3_5_VISION = dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=2, out_hidden_size=64)
TINY_WRAPPERS = {
    "gemma3": Gemma3Config(  # ties its head to the embeddings: the checkpoint has no lm_head
        text_config=dict(
            TINY_TEXT, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2
        ),
        vision_config=dict(TINY_VISION, image_size=28, patch_size=14),
        mm_tokens_per_image=4,
    ),
    "qwen3_5": Qwen3_5Config(text_config=TINY_QWEN3_5_TEXT, vision_config=TINY_QWEN3_5_VISION),
    "qwen3_5_moe": Qwen3_5MoeConfig(
        text_config=dict(
            TINY_QWEN3_5_TEXT,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        vision_config=TINY_QWEN3_5_VISION,
    ),
    "mistral3": Mistral3Config(  # the wrapper ties the head, its text_config does not
        text_config=dict(TINY_TEXT, model_type="mistral"),
        vision_config=dict(TINY_VISION, model_type="pixtral", image_size=28, patch_size=14, head_dim=16),
    ),
    "llama4": Llama4Config(
        text_config=dict(
            TINY_TEXT,
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=96,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
        ),
        vision_config=dict(
            TINY_VISION,
            image_size=28,
            patch_size=14,
            vision_output_dim=32,
            projector_input_dim=32,
            projector_output_dim=64,
        ),
    ),
}


def save_random_wrapper(
    variant: str, path: Path, seed: int = 0, adjust: Callable[[torch.nn.Module], None] | None = None
) -> Path:
    """A random float32 multimodal wrapper of ``TINY_WRAPPERS``, vision tower included, saved as
    transformers saves it (its checkpoint layout, e.g. ``language_model.model.layers.N.``)."""
    config = copy.deepcopy(TINY_WRAPPERS[variant])
    return save_random_model(config, path, seed, adjust, auto_class=AutoModelForImageTextToText)


@pytest.fixture(scope="session")
def tiny_wrapper_path(tmp_path_factory):
    """``tiny_wrapper_path("gemma3")`` → a directory with a tiny random wrapper of that type."""
    cache: dict[str, Path] = {}

    def build(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = save_random_wrapper(
                variant, tmp_path_factory.mktemp(variant) / f"tiny-{variant}"
            )
        return cache[variant]

    return build


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """``tiny_model_path("llama")`` → a directory with a tiny random model of that variant."""
    cache: dict[str, Path] = {}

    def build(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = save_tiny_model(variant, tmp_path_factory.mktemp(variant) / f"tiny-{variant}")
        return cache[variant]

    return build


@pytest.fixture(scope="session")
def tiny_model_with_tokenizer(tiny_model_path, tmp_path_factory):
    """The tiny llama with a tokenizer (a word-level one built offline), so `petals generate` can start."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = tmp_path_factory.mktemp("with-tokenizer") / "tiny-llama"
    shutil.copytree(tiny_model_path("llama"), target)
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 1000)}, "hi": 999}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(target)
    return target


def install_in_hf_cache(
    source: Path, repo_id: str, cache_dir: Path, revision: str = "0" * 40, as_blobs: bool = False
) -> Path:
    """Lay out ``source``'s files as the Hugging Face hub cache does for ``repo_id`` (no network);
    ``as_blobs``: as the hub client writes them, each file a blob named by its checksum (sha256 for LFS
    files such as safetensors shards, git's sha1 for the others) and a link to it in the snapshot."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for file in source.iterdir():
        data = file.read_bytes()
        if not as_blobs:
            (snapshot / file.name).write_bytes(data)
            continue
        lfs = file.suffix == ".safetensors"
        name = (
            hashlib.sha256(data).hexdigest()
            if lfs
            else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        )
        (repo / "blobs").mkdir(exist_ok=True)
        (repo / "blobs" / name).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../../blobs") / name)
    return snapshot


@pytest.fixture
def offline_hf_cache(tmp_path, monkeypatch):
    """An empty HF hub cache, used offline by every process this test starts."""
    cache_dir = tmp_path / "hf-cache"
    cache_dir.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache_dir


# ---- a real local swarm for client tests: see petals.testing.swarm ----------------------------
from petals.server.server import READY_MESSAGE  # noqa: E402
from petals.testing.swarm import (  # noqa: E402, F401
    LOOPBACK_CLIENT,
    InProcessDht,
    InProcessServer,
    ServerProcess,
    inprocess_swarm,
    running_swarm,
    start_server,
)


@contextmanager
def swarm_with_processes(
    model_path: Path, *block_ranges: str, processes: int, server_args: tuple[str, ...] = ()
) -> Iterator[tuple[InProcessDht, list[InProcessServer | ServerProcess]]]:
    """``running_swarm``'s swarm, but only the last ``processes`` servers are ``petals serve`` processes
    (those a test signals or kills); the bootstrap peer and the others run in this process."""
    with ExitStack() as stack:
        dht = stack.enter_context(InProcessDht().start())
        cut = len(block_ranges) - processes
        servers: list[InProcessServer | ServerProcess] = []
        for index, blocks in enumerate(block_ranges):
            args = ("--block_indices", blocks, "--torch_dtype", "float32", *server_args)
            if index < cut:
                server = InProcessServer(model_path, dht.initial_peers, *args).start(wait=False)
            else:
                server = start_server(
                    model_path, dht.initial_peers, *args, wait_ready=False, wait_joined=False, timeout=180
                )
            servers.append(stack.enter_context(server))
        for server in servers:
            if isinstance(server, ServerProcess):
                server.wait_for_log(READY_MESSAGE, timeout=180)
            else:
                server.wait_ready()
        yield dht, servers


def petals_health(initial_peers: list[str], *args: str) -> subprocess.CompletedProcess:
    """``petals health --loopback`` of the swarm that ``initial_peers`` lead to, its output captured."""
    peers = [item for peer in initial_peers for item in ("--initial_peers", peer)]
    return subprocess.run(
        [sys.executable, "-m", "petals.cli", "health", "--loopback", *peers, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


class KillServingServer(StoppingCriteria):
    """Never stops generation; after ``kill_after`` new tokens, SIGKILLs the server process that serves the
    session's span starting at block ``start``."""

    def __init__(self, session, servers, prompt_length: int, kill_after: int, start: int = 2) -> None:
        self.session, self.servers, self.prompt_length = session, servers, prompt_length
        self.kill_after, self.start = kill_after, start
        self.killed = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.killed is None and input_ids.shape[1] - self.prompt_length == self.kill_after:
            (peer_id,) = {str(span.peer_id) for span in self.session.route if span.start == self.start}
            self.killed = next(server for server in self.servers if server.peer_id == peer_id)
            self.killed.process.kill()
            self.killed.process.wait()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.fixture(scope="session")
def tiny_llama_swarm(tiny_model_path) -> Iterator[tuple[Path, list[str]]]:
    """(model path, initial peers) of one in-process swarm of tiny Llama, blocks 0:2 and 2:4, shared by
    every test that only reads from it (no server options, no faults)."""
    path = tiny_model_path("llama")
    with inprocess_swarm(path, "0:2", "2:4") as (dht, _):
        yield path, dht.initial_peers


# Debian's Chromium as the page tests start it (Playwright's own browser cannot be downloaded here). Its
# background services look up Google's hosts even headless and under Playwright's flags (tcpdump of a whole
# suite: accounts.google.com, update.googleapis.com, content-autofill.googleapis.com); it resolves no name
# at all here, so nothing it does leaves 127.0.0.1, where the pages are served by address.
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def launch_chromium(playwright):
    """A headless Chromium (``playwright.chromium.launch``) that resolves no host name; the test skips
    where Chromium is not installed (``make test`` installs it when run as root)."""
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} is not installed: sudo apt-get install chromium (or make test as root)")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS))


def imported_modules(log_lines) -> set[str]:
    """The modules a Python process run with ``PYTHONPROFILEIMPORTTIME=1`` imported, read from its stderr lines
    ("import time: <self us> | <cumulative us> | <indented module name>"). A module imported by
    ``importlib.import_module`` is not listed itself, only what its own import statements import."""
    return {line.rsplit("|", 1)[1].strip() for line in log_lines if line.startswith("import time:")}


@pytest.fixture(scope="session")
def chat_model_path(tmp_path_factory) -> Path:
    """A random 4-block Llama over SmolLM2's vocabulary, saved with SmolLM2's tokenizer (``petals api``
    needs one)."""
    return save_tiny_chat_llama(tmp_path_factory.mktemp("chat") / "tiny-chat-llama")
