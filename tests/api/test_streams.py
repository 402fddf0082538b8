"""Unit tests of the streaming pieces: stream entry merging and stop-string holdback."""

import json

from api.sse import _Choice
from llmpipe.streaming import apply_entries


def _e(i, off, ids):
    return (b"0-1", {b"i": str(i).encode(), b"o": str(off).encode(), b"d": json.dumps(ids).encode()})


def test_entries_merge_by_offset_and_replays_add_nothing():
    have: dict[int, list[int]] = {}
    assert apply_entries([_e(0, 0, [1, 2]), _e(1, 0, [9])], have) == {0: [1, 2], 1: [9]}
    # a redelivered request republishes from offset 0: only the unseen tail is new
    assert apply_entries([_e(0, 0, [1, 2, 3])], have) == {0: [3]}
    assert apply_entries([_e(0, 5, [7])], have) == {}  # a gap is not filled with guesses
    assert have == {0: [1, 2, 3], 1: [9]}


class CharText:
    """Each id is one character: chr(id)."""

    def push(self, ids):
        return "".join(chr(i) for i in ids)


def _ids(text):
    return [ord(c) for c in text]


def test_choice_never_sends_half_a_stop_string():
    c = _Choice(CharText(), stops=["END"])
    sent = c.push(_ids("hello E"))
    assert sent == "hello"  # "E" (and the space before it within the holdback) waits
    sent += c.push(_ids("N"))
    sent += c.push(_ids("D and more"))
    assert sent == "hello " and c.stopped
    assert c.push(_ids("ignored")) == ""


def test_choice_rest_completes_from_the_final_text():
    c = _Choice(CharText(), stops=[])
    assert c.push(_ids("abc")) == "abc"
    assert c.rest("abcdef") == "def"
    assert c.rest("abcdef") == ""
