"""Unit tests of the streaming pieces: stream entry merging and stop-string holdback."""

import json

from api.openai.sse import _Choice
from llmpipe.jobs.streaming import PromptInfo, TokenPublisher, apply_entries


def _e(i, off, ids):
    return (b"0-1", {b"i": str(i).encode(), b"o": str(off).encode(), b"d": json.dumps(ids).encode()})


def test_entries_merge_by_offset_and_replays_add_nothing():
    have: dict[int, list[int]] = {}
    assert apply_entries([_e(0, 0, [1, 2]), _e(1, 0, [9])], have) == {0: [1, 2], 1: [9]}
    # a redelivered request republishes from offset 0: only the unseen tail is new
    assert apply_entries([_e(0, 0, [1, 2, 3])], have) == {0: [3]}
    assert apply_entries([_e(0, 5, [7])], have) == {}  # a gap is not filled with guesses
    assert have == {0: [1, 2, 3], 1: [9]}


def test_streaming_entries_say_the_prompt_length_and_tail(redis_client):
    """What the usage on every chunk (continuous_usage_stats) and the API's decoding after
    the prompt need; a request that does not stream publishes ids only."""
    pub = TokenPublisher(redis_client, flush_s=60, partial_every_s=60)
    try:
        pub.register("j-0", "j", 0, True, prefix=[5], prompt_tokens=12, prompt_tail=[7, 8])
        pub.register("j-1", "j", 1, False, prompt_tokens=3, prompt_tail=[1])
        pub.on_tokens("j-0", [5, 6])
        pub.on_tokens("j-1", [4])
        pub.flush(force=True)
    finally:
        pub.close()
    have: dict[int, list[int]] = {0: [5]}  # the prefix, as an earlier delivery published it
    prompts: dict[int, PromptInfo] = {}
    assert apply_entries(redis_client.xrange("llmpipe:tokens:j"), have, prompts) == {0: [6], 1: [4]}
    assert prompts == {0: PromptInfo(12, [7, 8])}


def _choice(tiny_model, stops):
    from api.detok import Detokenizer
    from llmpipe.processors.detokenize import IncrementalDetokenizer

    tok = Detokenizer(tiny_model).tokenizer()
    return _Choice(IncrementalDetokenizer(tok, [], stops)), lambda text: tok.encode(text, add_special_tokens=False).ids


def test_choice_never_sends_half_a_stop_string(tiny_model):
    c, ids = _choice(tiny_model, ["END"])
    sent = "".join(c.push([t]) for t in ids("hello E"))
    assert sent == "hello " or sent == "hello"  # "E" (two characters, the stop's length less one) waits
    for t in ids("ND and more"):
        sent += c.push([t])
    assert sent == "hello " and c.stopped
    assert c.push(ids("ignored")) == ""


def test_choice_rest_completes_from_the_final_text(tiny_model):
    c, ids = _choice(tiny_model, [])
    assert c.push(ids("abc")) == "abc"
    assert c.rest("abcdef") == "def"
    assert c.rest("abcdef") == ""