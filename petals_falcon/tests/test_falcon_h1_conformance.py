"""petals-falcon passes the conformance kit on Falcon-H1, whose every layer runs a Mamba2 mixer beside
rotary grouped-query attention: its cache is both a fixed-size state (the convolution's inputs and the
SSM state, float32) and keys and values per token, served as one hybrid kind."""

import pytest
import torch
from transformers import FalconH1Config

from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, HybridSpec, LinearAttentionSpec, open_cache
from petals.plugins import get_plugin_manager
from petals.testing import check_family

CONFIG = FalconH1Config(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    mamba_d_ssm=64,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_chunk_size=4,  # shorter than the kit's prefill: the scan crosses chunks
    mamba_rms_norm=True,
    mlp_multipliers=[0.9, 1.1],
    ssm_multipliers=[1.0, 0.8, 1.2, 0.9, 1.1],
    key_multiplier=0.7,
    attention_in_multiplier=1.1,
    attention_out_multiplier=0.9,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.8,
    embedding_multiplier=1.5,
    lm_head_multiplier=0.5,
)
# Mamba2: a convolution over x (64) and B, C (2 groups x 8 each); a 16 x 8 state per head. Attention:
# 2 key/value heads of 16
HYBRID = HybridSpec(
    attention=FullAttentionSpec(num_kv_heads=2, key_dim=16, value_dim=16, num_query_heads=4),
    state=LinearAttentionSpec(conv_dim=64 + 2 * 2 * 8, conv_kernel=4, recurrent_shape=(4, 16, 8)),
)


def test_falcon_h1_conforms(tmp_path):
    report = check_family(CONFIG, tmp_path)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert report.merged_sessions_diff is not None
    config = get_plugin_manager().family("falcon_h1").config_class.from_dict(CONFIG.to_dict())
    assert [cache_spec(config, index) for index in range(4)] == [HYBRID] * 4


def test_a_hybrid_cache_holds_both_parts():
    dtype = torch.bfloat16
    assert HYBRID.bytes_per_token(dtype) == 2 * (16 + 16) * 2
    assert HYBRID.bytes_per_sequence(dtype) == (1 + HYBRID.state.snapshots) * (96 * 4 * 2 + 4 * 16 * 8 * 4)
    assert HYBRID.budget_bytes(4096, dtype) == 4096 * HYBRID.bytes_per_token(
        dtype
    ) + HYBRID.state.budget_bytes(4096, dtype)
    assert HYBRID.tokens_held(100) == 100 and HYBRID.describe() == "full attention and linear attention"
    cache = open_cache(HYBRID, 2, 32, dtype)
    assert cache.nbytes == cache.attention.nbytes + 2 * HYBRID.bytes_per_sequence(dtype)
    cache.release()


def test_tensor_parallelism_is_refused_in_one_line():
    pytest.importorskip(
        "tensor_parallel", reason="needs petals-core[tensor-parallel] (not in the oldest lane)"
    )
    from petals.block import make_block
    from petals.convert.tensor_parallel import make_tensor_parallel

    config = get_plugin_manager().family("falcon_h1").config_class.from_dict(CONFIG.to_dict())
    with pytest.raises(
        NotImplementedError, match="^model type 'falcon_h1': a full attention and linear attention"
    ):
        make_tensor_parallel(make_block(config, 0), config, ["cpu", "cpu"])
