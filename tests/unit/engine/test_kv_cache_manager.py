from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.prefix_hash import ROOT_HASH, block_hashes, hash_block
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def test_prefix_hash_is_chained_and_stable():
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2  # only full blocks
    assert hashes[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    # Same tokens after a different prefix hash differently.
    assert block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != hashes[1]
    # Stable across processes: a fixed digest, not Python's salted hash().
    assert hash_block(ROOT_HASH, [1, 2, 3]).hex() == hash_block(ROOT_HASH, [1, 2, 3]).hex()
    assert len(hash_block(ROOT_HASH, [1])) == 16


def test_allocate_exact_block_ids_and_free_all():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 1) == [0, 1, 2]  # slot 10 fits in block 2
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1) == [0, 1, 2, 3]
    kv.free("a")
    assert kv.num_free_blocks == 8


def test_allocation_failure_has_no_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(12)))
    kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    kv.free("a")
    second = make_request("b", list(range(12)))
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    # 12 tokens = 3 full blocks, but the last token must be recomputed: 2 blocks hit.
    assert [b.block_id for b in hits] == [0, 1] and num_hit_tokens == 8
    second.num_computed_tokens = 8
    assert kv.allocate_slots(second, 4, hits)[:2] == [0, 1]
    third = make_request("c", list(range(8)) + [99, 98, 97, 96, 95])
    hits, num_hit_tokens = kv.get_computed_blocks(third)
    assert num_hit_tokens == 8


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", list(range(6)))
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    kv.cache_full_blocks(parent)
    child = make_request("p/1", list(range(6)))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.block_ids("p/1") == [0, 1]
    assert kv.pool.blocks[1].ref_count == 2
    # The child writes into shared block 1 (slot 6): it gets a private copy.
    assert kv.allocate_slots(child, 1) == [0, 2]
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.pool.blocks[1].ref_count == 1
    # The parent now owns block 1 alone: no copy needed.
    assert kv.allocate_slots(parent, 1) == [0, 1]
    assert kv.take_pending_copies() == []
    kv.free("p")
    kv.free("p/1")
    assert kv.num_free_blocks == 8


def test_block_ids_handed_out_stay_as_they_were_when_the_blocks_change():
    """A decode token that fits the held blocks gets the same id list again; a new block or a copy on write
    gives a new list and leaves the one handed out before untouched (a step's plan keeps its table)."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", list(range(6)))
    first = kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    again = kv.allocate_slots(parent, 1)  # slot 6 fits block 1
    assert again == [0, 1] and again is first
    child = make_request("p/1", list(range(6)))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    copied = kv.allocate_slots(child, 1)  # block 1 is shared: the child copies it
    assert copied == [0, 2] and first == [0, 1]
    child.num_computed_tokens = 7
    assert kv.allocate_slots(child, 1) is copied  # slot 7 fits the copy
    assert kv.allocate_slots(parent, 1) is first  # block 1 is the parent's alone again
    parent.num_computed_tokens = 8
    grown = kv.allocate_slots(parent, 1)  # slot 8 needs block 3
    assert grown == [0, 1, 3] and first == [0, 1]
    kv.free("p")
    kv.free("p/1")
    assert kv.num_free_blocks == 8
    reused = kv.allocate_slots(make_request("p", [1, 2]), 2)  # the same id again: nothing of the old request
    assert len(reused) == 1 and kv.block_ids("p") == reused and grown == [0, 1, 3]
