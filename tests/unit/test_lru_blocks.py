from benchmarks.lru_blocks import LruBlocks


def test_touch_reports_new_blocks_and_evicts_the_least_recently_used():
    """Capacity 3: [1, 2, 3] fills it; touching [4, 1] adds 4 and makes 1 the most recent, so
    the oldest, 2, goes. 1 is then a one-block prefix hit of [1, 2, 4]; [3, 4] is held whole."""
    lru = LruBlocks(3)
    assert lru.touch([1, 2, 3]) == ([1, 2, 3], [])
    assert lru.touch([4, 1]) == ([4], [2])
    assert len(lru) == 3 and 2 not in lru
    assert lru.held_prefix([1, 2, 4]) == 1
    assert lru.held_prefix([3, 4]) == 2


def test_touching_a_chain_tail_first_keeps_its_root_longest():
    """How the index bench frees like vLLM: the root is touched last, so it is evicted last."""
    lru = LruBlocks(2)
    lru.touch(reversed([10, 11, 12]))
    assert 10 in lru and 11 in lru and 12 not in lru
