"""Incremental detokenizing for SSE: the streamed text plus the final tail is the full text."""

from __future__ import annotations

import random

from api.detok import Detokenizer, IncrementalText
from api.sse import _Choice


def test_streamed_deltas_complete_to_the_full_decode(tiny_model):
    detok = Detokenizer(tiny_model)
    tok = detok.tokenizer()
    rng = random.Random(7)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        c = _Choice(IncrementalText(tok), stops=[])
        sent = ""
        pos = 0
        while pos < len(ids):  # in chunks of 1-4 ids, as stream entries arrive
            n = rng.randint(1, 4)
            sent += c.push(ids[pos:pos + n])
            pos += n
        full = detok.decode(ids)
        assert full.startswith(sent)  # nothing sent is ever contradicted
        assert sent + c.rest(full) == full
