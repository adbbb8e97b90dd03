"""The served latent cache is exact against transformers with DeepSeek V3's own widths and rope, and in
merged steps compared with transformers directly.

What other tests already cover, on tiny widths (a latent of 16, a rope key of 8) and default rope:
``test_deepseek_conformance.py::test_deepseek_conforms`` runs the kit (transformers' forward without a
cache, which expands keys and values for every token; prefill, single-token and multi-token steps
against ``DynamicCache``; a beam reorder; a rewind and replay; merged sessions against their solo
runs), and ``tests/test_swarm_cache_kinds.py`` the same model through real servers, one killed
mid-generation. Added here: V3's real widths (a latent of 512, a rope key of 64, keys of 128 + 64 and
values of 128 per head) and its yarn rope, through the kit; and merged steps of several sessions (a
rewind and a reorder among them) compared with transformers' model run on each session alone.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DynamicCache

from petals.auto import AutoDistributedConfig
from petals.block import cache_spec
from petals.kv_cache import FullAttentionSpec, manager_for, open_cache
from petals.loading import load_block
from petals.testing import StepSchedule, check_family

ATOL = 1e-4
# DeepSeek V3's attention widths and rope (its config.json), with 2 heads, a narrow model and 4 experts
REAL_WIDTHS = DeepseekV3Config(
    hidden_size=128,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=128,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=96,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163_840,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
)
LATENT = FullAttentionSpec(num_kv_heads=1, key_dim=512, value_dim=64, num_query_heads=2)


def test_real_widths_and_yarn_rope_pass_the_kit(tmp_path):
    report = check_family(REAL_WIDTHS, tmp_path, schedule=StepSchedule(atol=ATOL))
    assert report.cache_specs == [LATENT] * 2
    assert max(report.max_abs_diff.values()) <= ATOL and report.merged_sessions_diff <= ATOL


# three sessions' steps by tick, {tick: (new tokens, rewind to, hypo_ids)}: different batch sizes and
# prompt lengths, started at different ticks; one rewinds two tokens and one reorders its beams while the
# others keep going, and a tick merges a multi-token step of two sessions
SESSIONS = [
    (1, {0: (5, None, None), 1: (1, None, None), 2: (1, None, None), 3: (1, 5, None), 4: (2, None, None)}),
    (
        2,
        {
            1: (3, None, None),
            2: (1, None, None),
            3: (1, None, [1, 0]),
            4: (2, None, None),
            5: (1, None, None),
        },
    ),
    (1, {2: (9, None, None), 3: (1, None, None), 4: (1, None, None), 5: (1, None, None)}),
]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek") / "Real-Widths"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(REAL_WIDTHS, dtype=torch.float32).save_pretrained(path)
    return path


def test_merged_steps_with_a_rewind_and_a_reorder_equal_transformers_per_session(saved_model):
    reference = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32).eval()
    config = AutoDistributedConfig.from_pretrained(saved_model)
    blocks = [load_block(saved_model, index, torch.float32, config=config) for index in range(2)]
    specs = [cache_spec(config, index) for index in range(2)]
    assert specs == [LATENT] * 2
    # small pages: steps cross page edges, and sessions' pages interleave in one pool per block
    pools = [manager_for(spec).make_pool(spec, 256, 3, torch.float32, "cpu") for spec in specs]
    ours = [
        [open_cache(pool.spec, batch, 32, pool=pool, layer_index=i) for i, pool in enumerate(pools)]
        for batch, _ in SESSIONS
    ]
    theirs = [DynamicCache(config=reference.config) for _ in SESSIONS]
    generator = torch.Generator().manual_seed(1)
    merged_sizes = set()

    with torch.no_grad():
        for tick in range(6):
            running = [index for index, (_, steps) in enumerate(SESSIONS) if tick in steps]
            ids, expected = {}, {}
            for index in running:
                batch, steps = SESSIONS[index]
                tokens, rewind_to, hypo_ids = steps[tick]
                if rewind_to is not None:
                    for cache in ours[index]:
                        cache.rewind(rewind_to)
                    theirs[index].crop(rewind_to - theirs[index].get_seq_length())
                if hypo_ids is not None:
                    for cache in ours[index]:
                        cache.reorder(torch.tensor(hypo_ids))
                    theirs[index].reorder_cache(torch.tensor(hypo_ids))
                ids[index] = torch.randint(0, REAL_WIDTHS.vocab_size, (batch, tokens), generator=generator)
                expected[index] = reference(input_ids=ids[index], cache=theirs[index], use_cache=True).logits

            for tokens in {ids[index].shape[1] for index in running}:
                group = [index for index in running if ids[index].shape[1] == tokens]
                merged_sizes.add(len(group))
                hidden = reference.model.embed_tokens(torch.cat([ids[index] for index in group]))
                for i, block in enumerate(blocks):
                    members = [ours[index][i] for index in group]
                    hidden = block(hidden, type(members[0]).merged(members))
                logits = reference.lm_head(reference.model.norm(hidden))
                for index, got in zip(group, logits.split([SESSIONS[i][0] for i in group]), strict=True):
                    diff = (got - expected[index]).abs().max().item()
                    assert diff <= ATOL, f"session {index} at tick {tick}, merged with {group}: {diff:.3g}"
            for index in running:
                assert all(cache.position == theirs[index].get_seq_length() for cache in ours[index])

    assert merged_sizes >= {2, 3}, merged_sizes  # steps did merge sessions, three at once among them
