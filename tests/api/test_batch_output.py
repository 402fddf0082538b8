"""The output writer (llmpipe/batches/output.py): resume after a crash, never a line twice."""

from __future__ import annotations

import json

from llmpipe.batches.output import BatchOutput, Line


def _ok(cid: str, tokens: int = 3) -> Line:
    body = {"usage": {"prompt_tokens": 2, "completion_tokens": tokens}}
    return Line(cid, {"custom_id": cid, "response": {"status_code": 200, "body": body}, "error": None}, ok=True)


def _err(cid: str) -> Line:
    return Line(cid, {"custom_id": cid, "response": None, "error": {"code": "batch_expired"}}, ok=False)


def _ids(path):
    return [json.loads(x)["custom_id"] for x in path.read_text().splitlines()]


def test_reopen_rebuilds_what_was_written_and_cuts_a_torn_line(tmp_path):
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    w = BatchOutput.open(out, err)
    assert w.write([_ok("a"), _ok("b"), _err("c")]) and w.counts.completed == 2 and w.counts.failed == 1
    w.close()
    with open(out, "ab") as f:  # the process died in the middle of a write
        f.write(b'{"custom_id": "d", "respo')
    w = BatchOutput.open(out, err)
    assert w.written == {"a", "b", "c"}
    assert (w.counts.completed, w.counts.failed, w.counts.input_tokens, w.counts.output_tokens) == (2, 1, 4, 6)
    assert out.read_bytes().endswith(b"\n") and _ids(out) == ["a", "b"]
    assert [ln.custom_id for ln in w.write([_ok("b"), _ok("d"), _err("a")])] == ["d"]  # written ones are skipped
    w.close()
    assert _ids(out) == ["a", "b", "d"] and _ids(err) == ["c"]


def test_seal_keeps_the_first_line_of_each_custom_id_across_both_files(tmp_path):
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    # Two processes appended (one stalled past its lease and woke up): duplicates, a garbled line.
    out.write_text("".join(json.dumps(ln.record) + "\n" for ln in (_ok("a"), _ok("b"), _ok("a"))) + "garbage\n")
    err.write_text("".join(json.dumps(ln.record) + "\n" for ln in (_err("b"), _err("c"), _err("c"))))
    w = BatchOutput.open(out, err)
    counts = w.seal()
    assert _ids(out) == ["a", "b"] and _ids(err) == ["c"]
    assert (counts.completed, counts.failed) == (2, 1) and w.written == {"a", "b", "c"}
    assert BatchOutput.open(out, err).seal().fields() == counts.fields()  # sealing again changes nothing
