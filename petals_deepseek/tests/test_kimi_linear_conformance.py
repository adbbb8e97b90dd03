"""petals-deepseek passes the conformance kit on Kimi Linear: Kimi Delta Attention layers (a short
convolution over queries, keys and values, then a gated delta rule with per-channel decay: a fixed-size
state per sequence) between latent attention layers without rotary positions (the latent and rope key
cached, as DeepSeek's), a dense first layer, then shared and routed experts."""

from transformers import KimiLinearConfig

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, LinearAttentionSpec
from petals.plugins import get_plugin_manager
from petals.testing import check_family

CONFIG = KimiLinearConfig(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    linear_num_heads=2,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    # two delta attention layers, latent attention, delta attention
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
)
# queries, keys and values of 2 heads x 16 in the convolution; a 16 x 16 state per head
DELTA = LinearAttentionSpec(conv_dim=3 * 32, conv_kernel=4, recurrent_shape=(2, 16, 16))
LATENT = FullAttentionSpec(num_kv_heads=1, key_dim=16, value_dim=8, num_query_heads=4)


def test_kimi_linear_conforms(tmp_path):
    report = check_family(CONFIG, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert report.merged_sessions_diff is not None
    config = get_plugin_manager().family("kimi_linear").config_class.from_dict(CONFIG.to_dict())
    assert [cache_spec(config, index) for index in range(4)] == [DELTA, DELTA, LATENT, DELTA]
    assert config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
