"""``petals serve`` and ``petals dht`` options, config files, environment variables and signals."""

from __future__ import annotations

import json
import signal

import pytest
from click.testing import CliRunner

from petals.cli import main
from petals.testing.swarm import start_dht


def serve(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, ["serve", *args], env=env)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--num-blocks", "1", "--block_indices", "0:1"],
            "--num_blocks and --block_indices are mutually exclusive",
        ),
        (
            ["--num_blocks", "1", "--port", "1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
            "--port and --host_maddrs",
        ),
        (
            [
                "--num_blocks",
                "1",
                "--public_ip",
                "1.2.3.4",
                "--port",
                "5",
                "--announce_maddrs",
                "/ip4/1.2.3.4/tcp/5",
            ],
            "--public_ip and --announce_maddrs",
        ),
        (
            ["--num_blocks", "1", "--initial_peers", "/ip4/127.0.0.1/tcp/1", "--new_swarm"],
            "--initial_peers and --new_swarm",
        ),
        (
            ["--num_blocks", "1", "--tensor-parallel-devices", "cpu", "cpu", "--quant_type", "nf4"],
            "--tensor_parallel_devices cannot be combined with --quant_type int8/nf4 or --adapters yet",
        ),
        (["--new_swarm", "--tensor_parallel_devices", "gpu0"], "Invalid device string: 'gpu0'"),
        (["--new_swarm", "--quant_type", "int3"], "'int3' is not one of 'none', 'int8', 'nf4'"),
        (["--block_indices", "3:1"], "expected START:END"),
        (["--num_blocks", "1", "--throughput", "fast"], "expected auto, eval, dry_run or a number"),
        (["--num_blocks", "1", "--loopback"], "--loopback cannot join the public swarm"),
    ],
)
def test_invalid_option_combinations_fail_clearly(tiny_model_path, args, message):
    result = serve(str(tiny_model_path("llama")), *args)
    assert result.exit_code == 2 and message in result.output


def test_config_file_and_environment_provide_options(tiny_model_path, tmp_path):
    config = tmp_path / "server.yml"
    config.write_text("num-blocks: 1\n")
    result = serve(str(tiny_model_path("llama")), "-c", str(config), "--block_indices", "0:1")
    assert result.exit_code == 2 and "mutually exclusive" in result.output
    result = serve(str(tiny_model_path("llama")), "--block-indices", "0:1", env={"PETALS_NUM_BLOCKS": "1"})
    assert result.exit_code == 2 and "mutually exclusive" in result.output


def test_throughput_dry_run_measures_caches_and_exits(tiny_model_path, tmp_path):
    args = [str(tiny_model_path("llama")), "--num_blocks", "3", "--new_swarm", "--cache_dir", str(tmp_path)]
    result = serve(*args, "--throughput", "dry_run")
    assert result.exit_code == 0, result.output
    measured = json.loads(result.output.strip().splitlines()[-1])
    assert (
        measured["throughput"] == pytest.approx(measured["forward_rps"] / 2) and measured["inference_rps"] > 0
    )
    cached = json.loads((tmp_path / "throughput_v1.json").read_text())
    assert [entry["forward_rps"] for entry in cached.values()] == [measured["forward_rps"]]


def test_pickle_only_adapter_is_refused_at_start(tiny_model_path, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"never unpickled")
    result = serve(str(tiny_model_path("llama")), "--new_swarm", "--adapters", str(tmp_path))
    assert result.exit_code == 1
    assert "only the pickle file adapter_model.bin, which petals refuses to unpickle" in result.output


def test_throughput_dry_run_measures_the_quantized_block_on_planned_blocks(tiny_model_path, tmp_path):
    args = [
        str(tiny_model_path("llama")),
        "--new_swarm",
        "--cache_dir",
        str(tmp_path),
        "--quant_type",
        "int8",
    ]
    result = serve(*args, "--throughput", "dry_run")
    assert result.exit_code == 0, result.output
    measured = json.loads(result.output.strip().splitlines()[-1])
    assert measured["throughput"] == pytest.approx(measured["forward_rps"] / 2.5)  # all 4 blocks fit
    (key,) = json.loads((tmp_path / "throughput_v1.json").read_text())
    assert key.endswith("_dtype_float32_quant_int8")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_dht_prints_multiaddrs_and_exits_cleanly(signum):
    dht = start_dht()
    assert dht.initial_peers and all(
        peer.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in peer for peer in dht.initial_peers
    )
    dht.process.send_signal(signum)
    assert dht.process.wait(15) == 0
    dht.stop()
