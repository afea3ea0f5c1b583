from benchmarks.vllm_overlap import expected_cached_tokens


def test_whole_blocks_only_and_never_the_last_token():
    # 200 tokens = 6 full blocks of 32 + 8: all 6 can be hit.
    assert expected_cached_tokens(6, 200, 32) == 192
    # 192 tokens = exactly 6 blocks: the last token is computed, so only 5 blocks hit.
    assert expected_cached_tokens(6, 192, 32) == 160
    # The index may know more blocks than this prompt has (a longer prompt stored them).
    assert expected_cached_tokens(10, 100, 32) == 96
    assert expected_cached_tokens(0, 100, 32) == 0
    assert expected_cached_tokens(3, 0, 32) == 0
