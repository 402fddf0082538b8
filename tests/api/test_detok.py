"""Incremental detokenizing for SSE: the streamed text plus the final tail is the full text."""

from __future__ import annotations

import random

from api.detok import Detokenizer
from api.openai.sse import _Choice
from llmpipe.messages import Detokenizing
from llmpipe.processors.detokenize import IncrementalDetokenizer


def test_streamed_deltas_complete_to_the_full_decode(tiny_model):
    detok = Detokenizer(tiny_model)
    tok = detok.tokenizer()
    rng = random.Random(7)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        c = _Choice(IncrementalDetokenizer(tok, [], []))
        sent = ""
        pos = 0
        while pos < len(ids):  # in chunks of 1-4 ids, as stream entries arrive
            n = rng.randint(1, 4)
            sent += c.push(ids[pos:pos + n])
            pos += n
        full = detok.decode(ids)
        assert full.startswith(sent)  # nothing sent is ever contradicted
        assert sent + c.rest(full) == full


def test_streamed_text_is_the_beginning_of_postprocess_text(tiny_model, tiny_tokenizer):
    """The API decodes after the prompt's last ids and leaves a stop id's text out, as
    postprocess does (vLLM's rules), so what it streams is never contradicted by the result."""
    from llmpipe.processors.detokenize import detokenize

    tok = Detokenizer(tiny_model).tokenizer()
    rng = random.Random(11)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        stop_ids = set()
        if rng.random() < 0.5:  # the engine stopped at a stop_token_ids id: the last one
            stop_ids = {ids[-1]}
            ids = [i for i in ids[:-1] if i != ids[-1]] + [ids[-1]]
        final = detokenize(tiny_tokenizer, ids, prompt_tail=tail, stop=[], stopped_by_token=bool(stop_ids)).text
        c = _Choice(IncrementalDetokenizer(tok, tail, []), frozenset(stop_ids))
        sent, pos = "", 0
        while pos < len(ids):
            n = rng.randint(1, 4)
            sent += c.push(ids[pos:pos + n])
            pos += n
        assert final.startswith(sent), (tail, ids, sent, final)
        assert sent + c.rest(final) == final
