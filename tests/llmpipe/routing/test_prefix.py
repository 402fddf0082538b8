"""The block hashes preprocess routes by (llmpipe/routing/prefix.py)."""

from __future__ import annotations

import pytest

from llmpipe.routing.prefix import block_hashes, boundaries


def test_every_block_is_a_boundary_up_to_16_then_two_per_doubling():
    assert boundaries(0) == []
    assert boundaries(5) == [1, 2, 3, 4, 5]
    assert boundaries(64) == [*range(1, 17), 24, 32, 48, 64]
    assert boundaries(100) == [*range(1, 17), 24, 32, 48, 64, 96]
    assert len(boundaries(100_000 // 16)) <= 36


def test_equal_prefixes_hash_equal_in_prompts_of_any_length():
    shared = list(range(1000, 1000 + 64))
    short = block_hashes(shared + [7] * 20, 16)
    long = block_hashes(shared + list(range(200)), 16)
    assert short[:4] == long[:4]  # the four shared blocks
    assert short[4] != long[4]  # the fifth differs
    assert len(short) == 5 and len(long) == len(boundaries((64 + 200) // 16))


def test_a_prefix_hash_covers_every_token_before_it():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # one token in the first block changes both


def test_a_partial_block_is_not_hashed():
    assert block_hashes([1, 2, 3], 4) == []
    assert len(block_hashes([1, 2, 3, 4, 5], 4)) == 1
    with pytest.raises(ValueError):
        block_hashes([1], 0)
