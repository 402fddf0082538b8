"""Validating a batch's input file (llmpipe/batches/input.py): every failure names its line."""

from __future__ import annotations

import json

import pytest

from llmpipe.batches.input import read_line, scan

URL = "/v1/chat/completions"


def _req(cid="a", **kw) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": URL, "body": {"messages": []}, **kw})


def _scan(tmp_path, text: str, **kw):
    p = tmp_path / "in.jsonl"
    p.write_text(text)
    return scan(p, endpoint=URL, max_lines=kw.get("max_lines", 100), max_bytes=kw.get("max_bytes", 1 << 20))


def test_a_good_file_gives_each_request_its_offset(tmp_path):
    s = _scan(tmp_path, _req("a") + "\n\n" + _req("b", body={"model": "m", "x": 1}) + "\n")
    assert not s.errors and [(ln.index, ln.line, ln.custom_id) for ln in s.lines] == [(0, 1, "a"), (1, 3, "b")]
    with open(tmp_path / "in.jsonl", "rb") as f:
        assert read_line(f, s.lines[1])["body"] == {"model": "m", "x": 1}
    assert s.models == {"", "m"}


@pytest.mark.parametrize("text,code,line,param", [
    ("not json\n", "invalid_json_line", 1, None),
    ("[1, 2]\n", "invalid_request", 1, None),
    (_req("a", method="GET") + "\n", "invalid_method", 1, "method"),
    (_req("a", url="/v1/completions") + "\n", "invalid_url", 1, "url"),
    (json.dumps({"method": "POST", "url": URL, "body": {}}) + "\n", "invalid_request", 1, "custom_id"),
    (_req("a", body="hi") + "\n", "invalid_request", 1, "body"),
    (_req("a") + "\n" + _req("b") + "\n" + _req("a") + "\n", "duplicate_custom_id", 3, "custom_id"),
    ("\n  \n", "empty_file", None, None),
])
def test_each_failure(tmp_path, text, code, line, param):
    s = _scan(tmp_path, text)
    assert [(e["code"], e["line"], e["param"]) for e in s.errors] == [(code, line, param)]


def test_limits(tmp_path):
    s = _scan(tmp_path, "".join(_req(f"c{i}") + "\n" for i in range(4)), max_lines=3)
    assert [(e["code"], e["line"]) for e in s.errors] == [("too_many_lines", 4)]
    s = _scan(tmp_path, _req("a") + "\n", max_bytes=10)
    assert [e["code"] for e in s.errors] == ["file_too_large"] and not s.lines


def test_every_error_is_listed_with_its_line(tmp_path):
    s = _scan(tmp_path, "x\n" + _req("a") + "\n" + "y\n")
    assert [(e["code"], e["line"]) for e in s.errors] == [("invalid_json_line", 1), ("invalid_json_line", 3)]
