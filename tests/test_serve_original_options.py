"""Every option of the original Petals ``run_server`` is accepted by ``petals serve``."""

from __future__ import annotations

import re

from petals.cli.original_options import NO_EFFECT
from petals.cli.run_server import serve_command
from petals.server.server import READY_MESSAGE
from petals.testing.swarm import InProcessDht, SwarmProcess

# `python -m petals.cli.run_server --help` of Petals 2.2 (cli/run_server.py), plus the Server
# keyword it passes through, --mean_block_selection_delay
ORIGINAL_OPTIONS = """
    --converted_model_name_or_path --config --public_name --token --use_auth_token --num_blocks
    --block_indices --dht_prefix --port --public_ip --no_auto_relay --host_maddrs --announce_maddrs
    --daemon_startup_timeout --compression --num_handlers --prefetch_batches --sender_threads
    --inference_max_length --min_batch_size --max_batch_size --max_chunk_size_bytes --attn_cache_tokens
    --cache_dir --max_disk_space --device --torch_dtype --max_alloc_timeout --revision --throughput
    --update_period --expiration --request_timeout --session_timeout --step_timeout --initial_peers
    --new_swarm --increase_file_limit --stats_report_interval --custom_module_path --identity_path
    --balance_quality --mean_balance_check_period --quant_type --tensor_parallel_devices
    --skip_reachability_check --adapters --mean_block_selection_delay
""".split()


def test_every_original_option_name_is_an_option_of_serve():
    ours = {name for param in serve_command.params for name in param.opts}
    assert [name for name in ORIGINAL_OPTIONS if name not in ours] == []


def test_a_server_started_with_the_original_options_serves_and_says_what_has_no_effect(
    tiny_model_path, tmp_path
):
    values = {"compression": "NONE", "custom_module_path": str(tmp_path / "custom.py")}
    no_effect_args = []
    for name in NO_EFFECT:
        no_effect_args += [f"--{name}", values.get(name, "1")]
    with InProcessDht().start() as dht:
        args = [
            "petals.cli.run_server",
            "--converted_model_name_or_path",
            str(tiny_model_path("llama")),
            "--loopback",
            "--initial_peers",
            dht.initial_peers[0],
            "--block_indices",
            "0:2",
            "--torch_dtype",
            "float32",
            "--prefix",
            "renamed-prefix",
            "--stats_report_interval",
            "30",
            "--use_auth_token",
            "--daemon_startup_timeout",
            "30",
            "--no_auto_relay",
            "--increase_file_limit",
            "--revision",
            "main",
            "--max_disk_space",
            "10GiB",
            "--skip_reachability_check",
            *no_effect_args,
        ]
        with SwarmProcess("petals serve (original options)", args) as server:
            server.wait_for_log(READY_MESSAGE, timeout=120)
            log = server.log
    assert "Hosting blocks 0:2 of renamed-prefix" in log
    # block loading is one progress bar, counting blocks and the MiB loaded
    assert re.search(r"Loading blocks: 100%.* 2/2 .*block 1, [\d.]+ MiB", log), log
    for name in NO_EFFECT:
        assert log.count(f"--{name} has no effect here") == 1, log
