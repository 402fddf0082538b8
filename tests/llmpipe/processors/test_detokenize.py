"""Text, stop strings and logprob token texts as vLLM's server makes them."""

from __future__ import annotations

import pytest

from llmpipe.messages import Logprob
from llmpipe.processors.detokenize import detokenize, name_logprobs, token_strings


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_plain_text_is_the_decode(tiny_tokenizer):
    ids = _ids(tiny_tokenizer, "Paris is lovely in spring, ñandú 日本語.")
    d = detokenize(tiny_tokenizer, ids, prompt_tail=_ids(tiny_tokenizer, "Hello"), stop=[], stopped_by_token=False)
    assert d.text == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert d.token_ids == ids and d.stop_string is None


def test_a_stop_token_is_kept_as_an_id_but_not_as_text(tiny_tokenizer):
    ids = _ids(tiny_tokenizer, "Paris is")
    d = detokenize(tiny_tokenizer, ids, prompt_tail=[], stop=[], stopped_by_token=True)
    assert d.token_ids == ids
    assert d.text == tiny_tokenizer.decode(ids[:-1])


def test_the_stop_string_completed_first_wins_and_cuts_the_ids(tiny_tokenizer):
    ids = _ids(tiny_tokenizer, "abc def ghi jkl")
    text = tiny_tokenizer.decode(ids)
    # "ghi" starts before " jk" ends, but " def" completes first: vLLM checks after each token.
    d = detokenize(tiny_tokenizer, ids, prompt_tail=[], stop=["ghi", " def"], stopped_by_token=False)
    assert d.stop_string == " def" and d.text == "abc"
    kept = d.token_ids
    assert " def" in tiny_tokenizer.decode(kept) and " def" not in tiny_tokenizer.decode(kept[:-1])
    assert text.startswith(tiny_tokenizer.decode(kept))
    # Ties go to the list's order; an absent stop string changes nothing.
    assert detokenize(tiny_tokenizer, ids, prompt_tail=[], stop=["zzz"], stopped_by_token=False).token_ids == ids


def test_logprob_tokens_match_vllms_own_decoding(tiny_tokenizer):
    vllm_logprobs = pytest.importorskip("vllm.v1.engine.logprobs")
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    # Byte pieces of multi-byte characters decode to U+FFFD alone; vLLM completes them from
    # the sampled tokens before them.
    sampled = _ids(tiny_tokenizer, "ñandú 日本語 🙂 é")
    alts = [17, 300, 167]
    positions = [[Logprob(id=t, logprob=-1.0, rank=1)] + [Logprob(id=a, logprob=-2.0, rank=2) for a in alts if a != t]
                 for t in sampled]
    ours = name_logprobs(tiny_tokenizer, positions)
    proc = vllm_logprobs.LogprobsProcessor(tokenizer=tiny_tokenizer, logprobs=[], prompt_logprobs=None,
                                           cumulative_logprob=0.0, num_logprobs=len(alts), num_prompt_logprobs=None)
    context: list[int] = []
    for pos, named in zip(positions, ours, strict=True):
        ids = [e.id for e in pos]
        want = proc._verify_tokens(convert_ids_list_to_tokens(tiny_tokenizer, ids), ids, context[-4:])
        assert [e.token for e in named] == want
        context.append(ids[0])
    assert any(tiny_tokenizer.decode([t]).endswith("\ufffd") for t in sampled)  # the case is exercised


def test_prompt_logprobs_first_position_is_decoded_plainly(tiny_tokenizer):
    ids = _ids(tiny_tokenizer, "hello there")
    positions = [[Logprob(id=ids[0])]] + [[Logprob(id=t, logprob=-3.0, rank=9)] for t in ids[1:]]
    named = name_logprobs(tiny_tokenizer, positions, prompt=True)
    assert named[0][0].token == tiny_tokenizer.decode([ids[0]]) and named[0][0].logprob is None
    assert [p[0].token for p in named[1:]] == token_strings(tiny_tokenizer, ids[1:])
