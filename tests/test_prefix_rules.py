"""dht_prefix rules reproduce Petals byte for byte, through the hook and through from_pretrained."""

import json
import subprocess
import sys

from conftest import install_in_hf_cache, tiny_config
from petals.auto import AutoDistributedConfig
from petals.testing import check_prefix_rules

PETALS_EXAMPLES = {
    "llama": ("meta-llama/Meta-Llama-3.1-405B-Instruct", "Meta-Llama-3-1-405B-Instruct-hf"),
    "bloom": ("bigscience/bloom", "bigscience/bloom-petals"),
    "falcon-new": ("tiiuae/falcon-180B-chat", "falcon-180B-chat"),
    "mixtral": ("mistralai/Mixtral-8x22B-Instruct-v0.1", "mistralai/Mixtral-8x22B-Instruct-v0-1"),
}


def test_prefix_hooks_match_petals_examples():
    for variant, (repo_id, prefix) in PETALS_EXAMPLES.items():
        check_prefix_rules({repo_id: prefix}, tiny_config(variant))
    check_prefix_rules({"meta-llama/Llama-2-70b-hf": "Llama-2-70b-hf"}, tiny_config("llama"))


def test_from_pretrained_derives_prefix_for_cached_repo_ids(tmp_path, offline_hf_cache):
    for variant, (repo_id, _) in PETALS_EXAMPLES.items():
        source = tmp_path / variant
        tiny_config(variant).save_pretrained(source)
        install_in_hf_cache(source, repo_id, offline_hf_cache)
    # a fresh process, so that HF_HUB_OFFLINE and HF_HUB_CACHE apply from the start
    script = (
        "import json, sys; from petals import AutoDistributedConfig as A; "
        "print(json.dumps({r: A.from_pretrained(r).dht_prefix for r in sys.argv[1:]}))"
    )
    repos = [repo_id for repo_id, _ in PETALS_EXAMPLES.values()]
    result = subprocess.run(
        [sys.executable, "-c", script, *repos], capture_output=True, text=True, check=True
    )
    derived = json.loads(result.stdout.strip().splitlines()[-1])
    assert derived == {repo_id: prefix for repo_id, prefix in PETALS_EXAMPLES.values()}


def test_local_directory_uses_folder_name_and_explicit_prefix_wins(tmp_path):
    tiny_config("bloom").save_pretrained(tmp_path / "my-bloom.v2")
    assert AutoDistributedConfig.from_pretrained(tmp_path / "my-bloom.v2").dht_prefix == "my-bloom-v2-petals"
    config = AutoDistributedConfig.from_pretrained(tmp_path / "my-bloom.v2", dht_prefix="team-bloom")
    assert config.dht_prefix == "team-bloom"


def test_invalid_explicit_prefix_is_refused(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path / "m")
    for bad in ("has.dot", "has space"):
        try:
            AutoDistributedConfig.from_pretrained(tmp_path / "m", dht_prefix=bad)
        except ValueError as error:
            assert "invalid dht_prefix" in str(error)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_family_config_defaults(tmp_path):
    for variant, expected_pad in [("falcon-rw", 0), ("mixtral", 0), ("llama", None)]:
        config = tiny_config(variant)
        config.pad_token_id = None
        config.save_pretrained(tmp_path / variant)
        loaded = AutoDistributedConfig.from_pretrained(
            tmp_path / variant, initial_peers=["/ip4/127.0.0.1/tcp/1"]
        )
        assert loaded.pad_token_id == expected_pad
        assert list(loaded.initial_peers) == ["/ip4/127.0.0.1/tcp/1"]
        assert json.loads((tmp_path / variant / "config.json").read_text())["model_type"] == loaded.model_type
