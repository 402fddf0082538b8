"""The hashes of a prompt's leading token blocks, as preprocess routes by them.

vLLM's prefix cache holds whole blocks of ``block_size`` tokens, each keyed by the hash of
every token up to its end, so two prompts share cached KV exactly as far as they share whole
leading blocks. The router looks up where each leading prefix last went, longest first.
Every block boundary up to 16 blocks is hashed, then two per doubling (24, 32, 48, 64, 96,
...): where a boundary falls depends on its position only, never on the prompt's length, so
equal prefixes hash equal in prompts of any length, and a prompt of 100,000 tokens still
costs 36 lookups.
"""

from __future__ import annotations

import hashlib
from array import array

EVERY_BLOCK_UP_TO = 16


def boundaries(n_blocks: int) -> list[int]:
    """The block counts at which a prompt of ``n_blocks`` whole blocks is hashed, ascending."""
    out = list(range(1, min(n_blocks, EVERY_BLOCK_UP_TO) + 1))
    k = EVERY_BLOCK_UP_TO
    while True:
        for b in (k + k // 2, 2 * k):
            if b > n_blocks:
                return out
            out.append(b)
        k *= 2


def block_hashes(token_ids: list[int], block_size: int) -> list[str]:
    """One hex digest per boundary, shortest prefix first; each covers every token before it.
    A prompt shorter than one block has none (no engine caches a partial block)."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    out: list[str] = []
    h = hashlib.blake2b(digest_size=12)
    start = 0
    for b in boundaries(len(token_ids) // block_size):
        end = b * block_size
        h.update(array("q", token_ids[start:end]).tobytes())
        out.append(h.hexdigest())
        start = end
    return out
