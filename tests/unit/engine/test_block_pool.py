from shared.engine.block_pool import BlockPool


def test_allocation_takes_lowest_free_blocks_and_fails_cleanly():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.get_new_blocks(2) is None
    assert pool.num_free_blocks == 1  # a failed allocation changes nothing


def test_freed_cached_blocks_are_evicted_lru_first():
    pool = BlockPool(3, record_events=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free([b])
    pool.free([a])  # order of freeing: b is least recently used
    pool.free([c])
    assert pool.num_free_blocks == 3
    assert pool.lookup(b"ha") is a and pool.lookup(b"hb") is b
    (first,) = pool.get_new_blocks(1)
    assert first is b  # LRU evicted first
    assert pool.lookup(b"hb") is None
    assert pool.lookup(b"ha") is a
    assert [e.kind for e in pool.drain_events()] == ["stored", "stored", "evicted"]


def test_touch_revives_cached_block_and_ref_counts():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"h")
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    pool.touch([a])
    assert a.ref_count == 2 and pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 2


def test_duplicate_hash_is_not_registered_twice():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.lookup(b"same") is a
    assert b.block_hash is None
    assert pool.num_cached_blocks == 1


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"h")
    assert pool.lookup(b"h") is None


def test_events_are_not_kept_without_a_consumer():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"h")
    pool.free([a])
    pool.get_new_blocks(2)
    assert pool.drain_events() == []
