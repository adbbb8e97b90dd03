"""A server's blocks share per-step work (rotary embeddings, the mask decision); results stay exact.

Consecutive blocks of a server run on the same rows at the same positions, so a block reuses the
rotary ``(cos, sin)`` the previous block computed. These tests make every reuse a chance to be
wrong: merges whose members have the same lengths but rows in another layout, and single tokens
after prefills, each checked against the same blocks run one session at a time.
"""

import pytest
import torch

from petals.block import allocate_cache, cache_spec
from petals.kv_cache import AttentionCache, PagePool
from petals_llama.block import LlamaBlock
from petals_llama.config import DistributedLlamaConfig

CONFIG = DistributedLlamaConfig(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=100,
)


@pytest.fixture(scope="module")
def blocks():
    torch.manual_seed(0)
    return [LlamaBlock(CONFIG, index).eval() for index in range(CONFIG.num_hidden_layers)]


def run(blocks, caches_per_session, hidden):
    with torch.no_grad():
        for index, block in enumerate(blocks):
            hidden = block(hidden, AttentionCache.merged([caches[index] for caches in caches_per_session]))
    return hidden


def solo(blocks, prefill, step):
    caches = [allocate_cache(CONFIG, prefill.shape[0], 32, block_index=index) for index in range(len(blocks))]
    run(blocks, [caches], prefill)
    return run(blocks, [caches], step)


def test_merges_with_equal_lengths_but_other_row_layouts_get_their_own_positions(blocks):
    generator = torch.Generator().manual_seed(1)
    pools = [PagePool(cache_spec(CONFIG, index), num_pages=32, page_tokens=4) for index in range(len(blocks))]

    def session(batch_size, length):
        prefill = torch.randn(batch_size, length, CONFIG.hidden_size, generator=generator)
        step = torch.randn(batch_size, 1, CONFIG.hidden_size, generator=generator)
        caches = [AttentionCache.paged(pool, batch_size, 32, index) for index, pool in enumerate(pools)]
        run(blocks, [caches], prefill)
        return caches, prefill, step

    # the same lengths (5 then 7) and the same 3 rows, laid out as 1+2 and then as 2+1, run back to back
    layouts = [
        [session(batch_size, length) for batch_size, length in layout]
        for layout in (((1, 5), (2, 7)), ((2, 5), (1, 7)))
    ]
    merged = [
        run(blocks, [caches for caches, _, _ in sessions], torch.cat([step for _, _, step in sessions]))
        for sessions in layouts
    ]
    for sessions, output in zip(layouts, merged, strict=True):
        expected = torch.cat([solo(blocks, prefill, step) for _, prefill, step in sessions])
        torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)


def test_one_token_steps_equal_a_full_forward_over_the_whole_sequence(blocks):
    """A one-token step needs no mask (sdpa attends to every cached key); a longer step after a prefix does."""
    generator = torch.Generator().manual_seed(2)
    sequence = torch.randn(2, 9, CONFIG.hidden_size, generator=generator)
    with torch.no_grad():
        full = sequence
        for block in blocks:
            full = block(full, None)
    caches = [allocate_cache(CONFIG, 2, 32, block_index=index) for index in range(len(blocks))]
    steps = [run(blocks, [caches], sequence[:, :4])]
    steps.append(run(blocks, [caches], sequence[:, 4:6]))
    steps += [run(blocks, [caches], sequence[:, position : position + 1]) for position in range(6, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
