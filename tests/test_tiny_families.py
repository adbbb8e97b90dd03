"""Every model type the installed plugins register has a tiny config in ``benchmarks.tiny_families`` (or a
reason there why not), so that the GPU check serves every family; each config is of its model type and
every one of its blocks caches a kind that servers serve."""

from benchmarks.tiny_families import CONFIGS, LEFT_OUT, cache_specs, tiny_config
from petals.kv_cache import MANAGERS
from petals.plugins import get_plugin_manager


def test_every_registered_model_type_has_a_tiny_config_or_a_reason():
    registered = set(get_plugin_manager().model_families())
    assert registered - set(CONFIGS) - set(LEFT_OUT) == set()
    assert set(CONFIGS) & set(LEFT_OUT) == set()


def test_each_tiny_config_is_of_its_model_type_and_its_cache_kinds_are_served():
    registered = get_plugin_manager().model_families()
    for model_type in CONFIGS.keys() & registered.keys():
        config = tiny_config(model_type)
        assert (config.model_type, config.num_hidden_layers, config.vocab_size) == (model_type, 4, 1000)
        unserved = [spec for spec in cache_specs(config) if type(spec) not in MANAGERS]
        assert not unserved, model_type
