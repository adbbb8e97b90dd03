"""``make image-test``'s own code, the parts that need no podman, so that it cannot rot between its runs:
its image checks against the configuration the Dockerfiles declare and a fake image file system, and
its swarm helpers (starting, checking, generating through and stopping a server) against a real local
``petals serve`` configured the way the image's server is, through ``PETALS_*`` variables."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys

import pytest
from test_deploy import DEPLOY, DOCKERFILES, runtime

from petals.testing.swarm import ServerProcess, start_dht, start_server


def load_image_test():
    spec = importlib.util.spec_from_file_location("image_test", DEPLOY / "image_test.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


image_test = load_image_test()


def declared_config() -> dict:
    """The image configuration ``podman image inspect`` reports for what deploy/Dockerfile.cpu declares."""
    settings = runtime(DOCKERFILES[0])
    return {
        "Cmd": json.loads(settings["CMD"]),  # the exec form: a JSON list of strings
        "Env": settings["ENV"].split(),
        "Volumes": {settings["VOLUME"]: {}},
        "User": settings["USER"],
        "StopSignal": settings["STOPSIGNAL"],
    }


def fake_root(tmp_path, user: str):
    """A file system with ``user`` as uid 1000 in its /etc/passwd and an empty /opt/venv/bin."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text(
        f"root:x:0:0:root:/root:/bin/sh\n{user}:x:1000:1000::/home/{user}:/bin/sh\n"
    )
    (tmp_path / "opt/venv/bin").mkdir(parents=True)
    return tmp_path


def test_the_image_checks_pass_on_what_the_dockerfile_declares(tmp_path, capsys):
    config = declared_config()
    image_test.check_config(config)
    image_test.check_file_system(config, fake_root(tmp_path, config["User"]))
    said = capsys.readouterr().out
    assert said.count("  ok: ") == 7, said


@pytest.mark.parametrize(
    ("change", "failure"),
    [
        (lambda config, root: config.update(User="root"), "runs as user root (uid 0), not root"),
        (lambda config, root: config.update(StopSignal="SIGKILL"), "stop signal SIGTERM"),
        (lambda config, root: (root / "opt/venv/bin/pip").touch(), "found /opt/venv/bin/pip"),
        (lambda config, root: (root / "src").mkdir(), "no sources"),
    ],
)
def test_the_image_checks_catch_a_wrong_image(tmp_path, change, failure):
    config = declared_config()
    root = fake_root(tmp_path, config["User"])
    change(config, root)
    with pytest.raises(image_test.ImageTestError, match=re.escape(failure)):
        image_test.check_config(config)
        image_test.check_file_system(config, root)


def test_the_swarm_helpers_run_a_server_configured_as_the_image_s(tiny_model_with_tokenizer, tmp_path):
    """``checked_server``, ``check_generation`` and ``check_stop`` as ``make image-test`` calls them, with the
    image's server replaced by a ``petals serve`` on this host given the same ``PETALS_*`` settings."""
    model, volume = tiny_model_with_tokenizer, tmp_path / "cache"
    volume.mkdir()
    with contextlib.ExitStack() as stack:
        dht = stack.enter_context(start_dht())
        host = stack.enter_context(
            start_server(model, dht.initial_peers, "--block_indices", "0:2", "--torch_dtype", "float32")
        )
        settings = {**image_test.server_settings(dht.initial_peers, "2:4"), "PETALS_CACHE": str(volume)}
        served = stack.enter_context(
            ServerProcess(
                "petals serve as in the image", ["petals.cli", "serve", str(model), "--loopback"], settings
            )
        )
        image_test.checked_server(served, os.getuid(), volume, "2:4")
        image_test.check_generation(model, dht.initial_peers, {host.peer_id, served.peer_id}, chat=False)
        image_test.check_stop("SIGTERM", served, model, dht.initial_peers, "2:4")


@pytest.mark.slow
def test_the_reference_answer_reads_the_demo_folder_as_the_demo_prepares_it():
    """The host-side reference of ``check_generation`` on the demo's prepared folder, which holds a GGUF
    file and no config.json: loading it as a Hugging Face folder broke ``make image-test``."""
    from transformers import AutoTokenizer

    from petals.cli.demo import QUESTION
    from petals.cli.generate import encode
    from petals.demo_model import prepare_demo_model

    model = prepare_demo_model()  # the default cache, as test_api and test_cli_chat use it
    tokenizer = AutoTokenizer.from_pretrained(model)
    inputs = encode(tokenizer, QUESTION, chat=True)
    answer = image_test.reference_answer(model, inputs)
    prompt_length = inputs["input_ids"].shape[1]
    assert prompt_length < answer.shape[1] <= prompt_length + image_test.DEMO_MAX_NEW_TOKENS
    assert "Paris" in tokenizer.decode(answer[0, prompt_length:])
