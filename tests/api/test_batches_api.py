"""/v1/files and /v1/batches through the ``openai`` client, against the app with a real Redis and
no workers: uploads, listing, validation failures, line errors (the synchronous endpoint's
answers), cancel, retention, metrics. Lines that would run stay queued; the runs are in
tests/integration/test_batches.py."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
from fastapi.testclient import TestClient

from llmpipe.settings import Settings

URL = "/v1/chat/completions"


@pytest.fixture
def app_client(redis_client, redis_url, tmp_path):
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, max_tokens_limit=100, batch_scan_interval_s=0.05,
                 batch_max_file_bytes=3 << 20)
    with TestClient(create_app(s)) as tc:
        yield tc


@pytest.fixture
def client(app_client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=app_client, max_retries=0)


def _line(cid: str, body: dict | None = None, **kw) -> dict:
    return {"custom_id": cid, "method": "POST", "url": URL,
            "body": body or {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, **kw}


def _upload(client, lines: list[dict] | bytes, name="in.jsonl"):
    data = lines if isinstance(lines, bytes) else "".join(json.dumps(x) + "\n" for x in lines).encode()
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def _until(client, batch_id: str, statuses: tuple[str, ...], timeout: float = 20.0):
    end = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < end, f"batch {batch_id} still {b.status}"
        time.sleep(0.02)


def test_files_round_trip(client, app_client, tmp_path):
    a = _upload(client, [_line("a")], "a.jsonl")
    b = _upload(client, b"x" * (2 << 20), "big.bin")  # twice max_body_bytes: an upload has its own limit
    assert (a.object, a.purpose, a.filename, a.status) == ("file", "batch", "a.jsonl", "processed")
    assert b.bytes == 2 << 20 and client.files.retrieve(b.id) == b
    assert client.files.content(b.id).content == b"x" * (2 << 20)
    assert [f.id for f in client.files.list().data] == [b.id, a.id]
    page = client.files.list(limit=1, order="asc")
    assert [f.id for f in page.data] == [a.id] and page.has_more
    assert [f.id for f in client.files.list(limit=1, order="asc", after=a.id).data] == [b.id]
    assert [f.id for f in client.files.list(purpose="batch_output").data] == []
    assert client.files.delete(a.id).deleted
    with pytest.raises(openai.NotFoundError) as err:
        client.files.retrieve(a.id)
    assert err.value.body["type"] == "not_found"
    assert app_client.get(f"/v1/files/{a.id}/content").status_code == 404
    assert not list((tmp_path / "batches" / "files").glob(f"{a.id}*"))
    r = app_client.get("/v1/files", params={"after": "file-nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "after"


def test_an_upload_over_its_limit_is_refused_as_it_streams(client, app_client, tmp_path):
    with pytest.raises(openai.APIStatusError) as err:
        _upload(client, b"y" * ((3 << 20) + 1))
    assert err.value.status_code == 413 and err.value.body["type"] == "limit_exceeded"
    assert "batch_max_file_bytes" in err.value.body["message"]
    assert list((tmp_path / "batches" / "files").glob("*")) == [] and client.files.list().data == []


@pytest.mark.parametrize("kw,param", [
    ({"files": {"file": ("a", b"{}")}, "data": {"purpose": "fine-tune"}}, "purpose"),
    ({"files": {"file": ("a", b"{}")}}, "purpose"),
    ({"data": {"purpose": "batch"}, "files": {"other": ("a", b"{}")}}, "file"),
    ({"json": {"purpose": "batch"}}, "file"),
    ({"files": {"file": ("a", b"{}")}, "data": {"purpose": "batch", "expires_after[anchor]": "created_at",
                                                "expires_after[seconds]": "60"}}, "expires_after[seconds]"),
    ({"files": {"file": ("a", b"{}")}, "data": {"purpose": "batch", "expires_after[anchor]": "last_used"}},
     "expires_after[anchor]"),
])
def test_a_bad_upload_is_400_naming_the_field(app_client, kw, param):
    r = app_client.post("/v1/files", **kw)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("fields,ttl", [
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}, 3600),
    ({"expires_after[seconds]": "7200"}, 7200),  # created_at is the only anchor
    ({"expires_after[anchor]": "created_at"}, 30 * 24 * 3600),  # no seconds: the retention
])
def test_expires_after(app_client, fields, ttl):
    r = app_client.post("/v1/files", files={"file": ("a", b"{}")}, data={"purpose": "batch", **fields})
    f = r.json()
    assert r.status_code == 200 and f["expires_at"] - f["created_at"] == ttl


@pytest.mark.parametrize("lines,errors", [
    (b'{"custom_id": "a"\n', [("invalid_json_line", 1)]),
    ([_line("a"), _line("a")], [("duplicate_custom_id", 2)]),
    ([_line("a"), _line("b", url="/v1/completions")], [("invalid_url", 2)]),
    ([_line("a", method="GET")], [("invalid_method", 1)]),
    (b"", [("empty_file", None)]),
])
def test_a_file_that_fails_validation_fails_the_batch_and_nothing_runs(client, redis_client, lines, errors):
    f = _upload(client, lines)
    b = client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h")
    assert b.status == "validating"
    b = _until(client, b.id, ("failed",))
    assert [(e.code, e.line) for e in b.errors.data] == errors and b.failed_at and b.output_file_id is None
    assert list(redis_client.scan_iter("llmpipe:job:*")) == []


def test_too_many_lines_or_bytes_fail_validation(redis_client, redis_url, tmp_path):
    from api.app import create_app

    s = Settings(redis_url=redis_url, state_dir=tmp_path, batch_scan_interval_s=0.05, batch_max_lines=2)
    with TestClient(create_app(s)) as tc:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=tc, max_retries=0)
        f = _upload(c, [_line(f"c{i}") for i in range(3)])
        b = _until(c, c.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h").id, ("failed",))
        assert [(e.code, e.line) for e in b.errors.data] == [("too_many_lines", 3)]
    s = Settings(redis_url=redis_url, state_dir=tmp_path, batch_scan_interval_s=0.05, batch_max_file_bytes=100)
    with TestClient(create_app(s)) as tc:  # an upload made under a larger limit
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=tc, max_retries=0)
        b = _until(c, c.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h").id, ("failed",))
        assert [e.code for e in b.errors.data] == ["file_too_large"]


BAD_BODIES = {
    "over-limit": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000},
    "unknown-model": {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    "invalid": {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    "no-messages": {"messages": []},
}


def test_a_bad_line_fails_alone_with_the_endpoints_answer_and_a_cancel_ends_the_rest(client, app_client,
                                                                                     redis_client):
    lines = [_line(cid, body) for cid, body in BAD_BODIES.items()] + [_line("good"),
                                                                       _line("stream", {**_line("x")["body"], "stream": True})]
    f = _upload(client, lines)
    b = client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h", metadata={"k": "v"})
    b = _until(client, b.id, ("in_progress",))
    end = time.monotonic() + 20
    while client.batches.retrieve(b.id).request_counts.failed < 5:
        assert time.monotonic() < end
        time.sleep(0.02)
    [good_job] = [k.decode() for k in redis_client.scan_iter(f"llmpipe:job:{b.id}-*")]  # it waits for a worker
    b = client.batches.cancel(b.id)
    assert b.status == "cancelling" and b.cancelling_at
    b = _until(client, b.id, ("cancelled",))
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (6, 0, 6)
    assert b.output_file_id is None and b.metadata == {"k": "v"} and b.model is None  # the lines name two models
    assert redis_client.hget(good_job, "status") == b"cancelled"
    rows = {x["custom_id"]: x for x in map(json.loads, client.files.content(b.error_file_id).text.splitlines())}
    assert rows["good"]["response"] is None and rows["good"]["error"]["code"] == "batch_cancelled"
    for cid, body in BAD_BODIES.items():
        sync = app_client.post(URL, json=body)
        resp = rows[cid]["response"]
        assert (resp["status_code"], resp["body"]) == (sync.status_code, sync.json()), cid
        assert rows[cid]["error"]["code"] == sync.json()["error"]["type"]
    assert rows["stream"]["response"]["status_code"] == 400 and rows["stream"]["error"]["code"] == "invalid_request"
    assert rows["unknown-model"]["response"]["status_code"] == 404
    assert client.batches.cancel(b.id).status == "cancelled"  # an ended batch stays as it is


def test_batches_list_retrieve_and_errors(client, app_client):
    f = _upload(client, b"")
    ids = [client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h").id for _ in range(3)]
    assert [x.id for x in client.batches.list(limit=2).data] == ids[::-1][:2]
    assert [x.id for x in client.batches.list(after=ids[1]).data] == [ids[0]]
    assert [x.id for x in client.batches.list(limit=100)] == ids[::-1]  # the client's auto-paging
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")
    with pytest.raises(openai.NotFoundError) as err:
        client.batches.create(input_file_id="file-nope", endpoint=URL, completion_window="24h")
    assert err.value.body["param"] == "input_file_id"
    r = app_client.post("/v1/batches", json={"input_file_id": f.id, "endpoint": "/v1/embeddings", "completion_window": "24h"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint"
    r = app_client.post("/v1/batches", json={"input_file_id": f.id, "endpoint": URL, "completion_window": "1 day"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_window"
    assert app_client.get("/v1/batches", params={"limit": 101}).status_code == 400


def test_a_batch_keeps_its_input_when_the_file_is_deleted(client):
    f = _upload(client, [_line("a")])
    b = client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h")
    client.files.delete(f.id)
    b = _until(client, b.id, ("in_progress",))
    assert b.request_counts.total == 1
    client.batches.cancel(b.id)
    assert _until(client, b.id, ("cancelled",)).request_counts.failed == 1


def test_metrics_count_batches_by_status_and_lines(client, app_client):
    f = _upload(client, b"nope\n")
    _until(client, client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h").id, ("failed",))
    text = app_client.get("/metrics").text
    assert 'llmpipe_batches{status="failed"} 1.0' in text and 'llmpipe_batches{status="completed"} 0.0' in text


def test_the_janitor_forgets_what_is_past_its_retention(client, app_client, redis_client, tmp_path):
    f = _upload(client, [_line("a")])
    b = client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="1s")
    b = _until(client, b.id, ("expired",))
    assert b.request_counts.failed == 1 and b.error_file_id
    st = app_client.app.state
    later = time.time() + st.settings.batch_retention_s + 10
    st.batch_runner.janitor(now=later)
    for fid in (f.id, b.error_file_id):
        assert app_client.get(f"/v1/files/{fid}").status_code == 404
    assert app_client.get(f"/v1/batches/{b.id}").status_code == 404
    assert not list((tmp_path / "batches" / "files").glob("*.jsonl"))


def test_non_multipart_is_400(app_client):
    r = app_client.post("/v1/files", content=b"raw", headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
