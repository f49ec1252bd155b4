"""Issue 18: a host tier for KV blocks. Evicted prefix-cache blocks are offloaded to host memory and come
back on a hit; greedy outputs never change; no block leaks in either tier; copies happen in decision order."""

import pytest
import torch

from engine.companions.naive import generate_naive
from engine.config import CacheConfig
from engine.kv.block_manager import BlockManager, BlockMove, HostBlock
from engine.kv.kv_pool import PagedKVPool
from engine.kv.prefix_cache import block_hashes
from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine_fixtures import random_model

BS = 4
KEY = ("model", None, "public")


def manager(num_blocks=4, num_host_blocks=3):
    return BlockManager(num_blocks, BS, enable_prefix_caching=True, num_host_blocks=num_host_blocks)


def compute(bm, seq_id, tokens):
    """What the engine does for one prompt: find its cached prefix, allocate, run (register), finish."""
    hit = bm.find_cached_prefix(tokens, KEY, len(tokens) - 1)
    bm.allocate(seq_id, len(tokens), hit)
    bm.cache_blocks(seq_id, tokens, KEY, len(tokens))
    return hit


# ---- the block manager ------------------------------------------------------------------------------


def test_an_evicted_cached_block_is_offloaded_and_a_later_hit_reloads_it():
    bm = manager(num_blocks=4)
    doc = list(range(10, 19))  # 2 full blocks + 1 token
    compute(bm, 0, doc)
    table = bm.block_table(0)
    bm.free(0)
    bm.take_moves()
    compute(bm, 1, list(range(50, 66)))  # 4 blocks: evicts the 2 cached ones, offloading them
    moves = bm.take_moves()
    assert [m.kind for m in moves] == ["offload", "offload"]
    assert sorted(m.src for m in moves) == sorted(table[:2])
    assert bm.host_usage().used_blocks == 2 and bm.num_offloaded == 2
    bm.free(1)
    hit = bm.find_cached_prefix(doc, KEY, len(doc) - 1)
    assert hit == [HostBlock(moves[1].dst), HostBlock(moves[0].dst)] or all(isinstance(h, HostBlock) for h in hit)
    assert len(hit) == 2
    bm.allocate(2, len(doc), hit)
    reloads = [m for m in bm.take_moves() if m.kind == "reload"]
    hashes = block_hashes(doc[:8], BS, KEY)
    assert [m.src for m in reloads] == [h.id for h in hit]
    assert [m.dst for m in reloads] == bm.block_table(2)[:2]
    assert [bm.prefix_cache.lookup(h) for h in hashes] == bm.block_table(2)[:2]  # on the device again
    assert all(bm.host_cache.lookup(h) is not None for h in hashes)  # the host keeps its copy too
    assert bm.num_reloaded == 2


def test_a_block_already_on_the_host_is_not_copied_again():
    bm = manager(num_blocks=4, num_host_blocks=16)  # room for every block of both prompts
    doc, other = list(range(10, 19)), list(range(50, 66))
    kinds = []
    for round_ in range(4):  # each prompt evicts the other's blocks from the device
        compute(bm, 10 * round_, doc)
        bm.free(10 * round_)
        compute(bm, 10 * round_ + 1, other)
        bm.free(10 * round_ + 1)
        kinds.append({m.kind for m in bm.take_moves()})
    assert kinds[0] == {"offload"} and kinds[1] == {"offload", "reload"}
    assert kinds[2] == kinds[3] == {"reload"}  # everything evicted now is on the host already: no copy
    assert bm.num_offloaded == bm.host_cache.num_hashes  # one copy per distinct block


def test_the_host_tier_is_an_lru_cache_that_drops_its_oldest_block_when_full():
    bm = manager(num_blocks=2, num_host_blocks=2)
    docs = [[d] * 5 for d in (3, 4, 5)]  # one full block each
    for i, doc in enumerate(docs):
        compute(bm, i, doc)
        bm.free(i)
    # doc 3's and doc 4's blocks were evicted to the host (the device holds 2 blocks), the host keeps 2
    assert bm.host_usage().used_blocks == 2
    compute(bm, 9, [7] * 8)  # evicts doc 5's block: the host drops its LRU block (doc 3's)
    assert bm.find_cached_prefix(docs[0], KEY, 4) == []
    assert isinstance(bm.find_cached_prefix(docs[1], KEY, 4)[0], HostBlock)


def test_an_eviction_while_every_host_block_is_being_reloaded_drops_the_block():
    bm = manager(num_blocks=2, num_host_blocks=1)
    doc = [3] * 5  # one full block
    compute(bm, 0, doc)
    bm.free(0)
    compute(bm, 1, [4] * 8)  # evicts doc's block: offloaded, the host is full
    bm.free(1)
    bm.take_moves()
    hit = compute(bm, 2, doc)  # reloads doc's block (pinned on the host) while evicting [4]*8's two blocks
    assert hit == [HostBlock(0)]
    assert [m.kind for m in bm.take_moves()] == ["reload"]  # nowhere to offload them: dropped, not copied
    assert bm.num_offloaded == 1 and bm.find_cached_prefix([4] * 8, KEY, 7) == []


def test_reset_prefix_cache_empties_the_host_tier_too():
    bm = manager(num_blocks=2)
    compute(bm, 0, [3] * 5)
    bm.free(0)
    compute(bm, 1, [4] * 8)
    bm.free(1)
    assert bm.host_usage().used_blocks == 1
    assert bm.reset_prefix_cache()
    host = bm.host_usage()
    assert (host.used_blocks, host.free_blocks) == (0, 3) and bm.find_cached_prefix([3] * 5, KEY, 4) == []


@pytest.mark.parametrize("options", [dict(kv_offload_blocks=4, enable_prefix_caching=False),
                                     dict(kv_offload_blocks=-1, enable_prefix_caching=True),
                                     dict(kv_offload_blocks=2.5, enable_prefix_caching=True)])
def test_bad_host_tier_options_name_the_field(options):
    with pytest.raises(ValueError, match="kv_offload_blocks"):
        CacheConfig(**options)


# ---- the KV pool does the copies in the order they were decided --------------------------------------


def test_apply_moves_keeps_the_decision_order_when_a_block_is_read_then_overwritten():
    pool = PagedKVPool(num_layers=2, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=4, num_host_blocks=2)
    for layer in range(2):
        for b in range(3):
            pool.k[layer][b] = b + 1  # device block b holds b + 1
            pool.v[layer][b] = -(b + 1)
    # block 0 goes to host 0, then host 0's copy is reloaded into block 2, then block 1 overwrites host 0
    moves = [BlockMove("offload", 0, 0), BlockMove("reload", 0, 2), BlockMove("offload", 1, 0)]
    assert pool.apply_moves(moves) == {"offload": 2, "reload": 1}
    for layer in range(2):
        assert pool.k[layer][2].eq(1).all() and pool.v[layer][2].eq(-1).all()  # block 0's K/V, not block 1's
        assert pool.k_host[layer][0].eq(2).all()
    assert pool.block_nbytes == 2 * 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, BS 2, Hkv 1, D 4, fp32


# ---- the engine: outputs unchanged, hits served from the host ------------------------------------------


def documents_workload(num_docs=3, doc_len=24, rounds=3, question_len=3, seed=0):
    """Requests cycling over a few long documents, each with its own short question."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, 101, (doc_len,), generator=g).tolist() for _ in range(num_docs)]
    return [docs[i % num_docs] + torch.randint(2, 101, (question_len,), generator=g).tolist()
            for i in range(num_docs * rounds)]


def run_one_at_a_time(model, prompts, params, **options):
    engine = LLMEngine(model, None, engine_config("random", **options))
    outputs = []
    for prompt in prompts:  # one after another, so each finds what the previous ones left
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        outputs.append(engine.get_request(rid).output_token_ids)
    return engine, outputs


def test_host_tier_serves_the_hits_the_device_pool_lost_and_outputs_stay_equal():
    model = random_model(seed=11)
    prompts = documents_workload()
    params = SamplingParams(temperature=0, max_tokens=6)
    base = dict(block_size=BS, num_blocks=16, enable_prefix_caching=True)  # holds about one document
    plain, out_plain = run_one_at_a_time(model, prompts, params, **base)
    tiered, out_tiered = run_one_at_a_time(model, prompts, params, **base, kv_offload_blocks=32)
    expected = [generate_naive(model, None, p, params).token_ids for p in prompts]
    assert out_plain == expected and out_tiered == expected

    def hit_tokens(engine, key):
        return sum(e[key] for r in engine.trace for e in r.events if e["type"] == "prefix_hit")

    assert hit_tokens(plain, "num_tokens") == 0  # every revisit found its document evicted
    assert hit_tokens(tiered, "num_host_tokens") == 6 * 24  # rounds 2 and 3: all 6 blocks from the host
    moved = [e for r in tiered.trace for e in r.events if e["type"] == "blocks_moved"]
    assert sum(e.get("reload", 0) for e in moved) == 6 * 6
    assert sum(e["bytes"] for e in moved) == sum(e.get("reload", 0) + e.get("offload", 0) for e in moved) * \
        tiered.kv_pool.block_nbytes
    for engine in (plain, tiered):
        assert engine.block_manager.usage().used_blocks == 0
    host = tiered.block_manager.host_usage()
    assert host.used_blocks + host.free_blocks == host.total_blocks == 32
