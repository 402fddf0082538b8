"""llmpipe's detokenizer (postprocess, the API's live decode, the parsed streams) against
vLLM's own FastIncrementalDetokenizer, on random outputs of the tiny model's vocabulary with
every detokenizing option: skip_special_tokens, spaces_between_special_tokens,
include_stop_str_in_output, stop strings, min_tokens, and a last token that stopped the
output. The text, the kept ids and the stop string are vLLM's, fed all at once and token
by token, and a stream never sends what a stop string takes back."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from llmpipe.messages import Detokenizing
from llmpipe.processors.detokenize import IncrementalDetokenizer, detokenize


def _vllm(tok, prompt, ids, stop, opts: Detokenizing, stop_terminated: bool):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    params = SamplingParams(max_tokens=64, stop=stop or None, min_tokens=opts.min_tokens,
                            skip_special_tokens=opts.skip_special_tokens,
                            spaces_between_special_tokens=opts.spaces_between_special_tokens,
                            include_stop_str_in_output=opts.include_stop_str_in_output)
    d = FastIncrementalDetokenizer(tok, SimpleNamespace(sampling_params=params, prompt_token_ids=prompt, request_id="r"))
    found = None
    for k, t in enumerate(ids):
        found = d.update([t], stop_terminated and k == len(ids) - 1)
        if found is not None:
            break
    return d.output_text, list(d.output_token_ids), found


OPTIONS = [Detokenizing(), Detokenizing(skip_special_tokens=False), Detokenizing(skip_special_tokens=False,
           spaces_between_special_tokens=False), Detokenizing(include_stop_str_in_output=True),
           Detokenizing(min_tokens=5), Detokenizing(skip_special_tokens=False, include_stop_str_in_output=True)]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.model_dump().items()
                                                                   if v != Detokenizing.model_fields[k].default) or "defaults")
def test_the_text_is_vllms_for_every_option(tiny_tokenizer, opts):
    rng = random.Random(5)
    vocab = len(tiny_tokenizer)
    words = ["the", "an", " a", "e", "<|im_end|>"]
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        ids = [rng.choice([rng.randrange(vocab), rng.randrange(5)]) for _ in range(rng.randint(1, 25))]
        stop = rng.sample(words, rng.randint(0, 2))
        stopped = rng.random() < 0.3
        text, kept, found = _vllm(tiny_tokenizer, prompt, ids, stop, opts, stopped)
        d = detokenize(tiny_tokenizer, ids, prompt_tail=prompt, stop=stop, stopped_by_token=stopped, opts=opts)
        assert (d.text, d.token_ids, d.stop_string) == (text, kept, found), (prompt, ids, stop, stopped)
        # Token by token, as a stream: what it sends is the final text's beginning, then all of it.
        inc = IncrementalDetokenizer(tiny_tokenizer, prompt, stop, opts)
        sent = ""
        for k, t in enumerate(ids):
            inc.update([t], stop_terminated=stopped and k == len(ids) - 1)
            sent += inc.next_text()
            assert text.startswith(sent)
        assert sent + inc.next_text(finished=True) == text
