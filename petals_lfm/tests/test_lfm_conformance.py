"""petals-lfm passes the conformance kit on LFM2 with both its layer kinds: gated short convolutions
(a fixed-size state of the convolution's last inputs, no recurrence) and full attention with q/k norms."""

import torch
from transformers import Lfm2Config

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, LinearAttentionSpec, open_cache
from petals.plugins import get_plugin_manager
from petals.testing import check_family

CONFIG = Lfm2Config(
    hidden_size=64,
    intermediate_size=96,
    block_auto_adjust_ff_dim=False,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    conv_L_cache=3,
    layer_types=["conv", "conv", "full_attention", "conv"],
)
# the convolution's last 3 inputs over the 64 channels; attention: 2 key/value heads of 16
SHORT_CONV = LinearAttentionSpec(conv_dim=64, conv_kernel=3, recurrent_shape=None)
SPECS = [
    SHORT_CONV,
    SHORT_CONV,
    FullAttentionSpec(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4),
]
SPECS.append(SHORT_CONV)


def test_lfm2_conforms(tmp_path):
    report = check_family(CONFIG, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert report.merged_sessions_diff is not None
    config = get_plugin_manager().family("lfm2").config_class.from_dict(CONFIG.to_dict())
    assert [cache_spec(config, index) for index in range(4)] == SPECS


def test_a_short_convolution_holds_its_inputs_only():
    assert SHORT_CONV.describe() == "short convolution"
    assert SHORT_CONV.bytes_per_token(torch.bfloat16) == 0
    assert SHORT_CONV.state_bytes(torch.bfloat16) == 64 * 3 * 2
    cache = open_cache(SHORT_CONV, 2, 16, torch.bfloat16)
    assert cache.pool.recurrent is None
    assert cache.nbytes == 2 * (1 + SHORT_CONV.snapshots) * 64 * 3 * 2 == cache.pool.nbytes
