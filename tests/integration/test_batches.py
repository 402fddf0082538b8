"""The OpenAI Batch API end to end with the ``openai`` client: real Redis (or RabbitMQ as the
broker), real workers, vLLM on the tiny model. Upload, batch, results; a line and the same
request to the synchronous endpoint answer the same body; a bad line fails alone with the
endpoint's answer; cancel; the completion window passing; the API process feeding a batch
killed mid-batch and another one finishing it with every line exactly once."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import redis

from llmpipe.batches.lease import BatchLeases, owner_pid
from llmpipe.local.pipeline import LocalPipeline
from llmpipe.local.redis_server import EmbeddedRedis, free_port
from tests.harness.shared import lends
from tests.harness.stacks import pipeline_key, pipeline_settings, start_pipeline, teardown
from tests.harness.waiting import wait_until

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
@lends(lambda params: pipeline_key("vllm", params["broker"]))
def stack(broker_url, borrow):
    """The shared vLLM pipeline of this module's broker (Redis, or RabbitMQ)."""
    return borrow("vllm", broker_url=broker_url)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)


def _chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **kw}


def _line(cid: str, body: dict, url: str = CHAT) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _submit(client: openai.OpenAI, lines: list[dict], endpoint: str = CHAT, window: str = "24h"):
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window)


def _wait(client: openai.OpenAI, batch_id: str, statuses=ENDED, timeout: float = 240, pred=None):
    def done():
        b = client.batches.retrieve(batch_id)
        return b if (b.status in statuses if pred is None else pred(b)) else None
    return wait_until(done, timeout, f"batch {batch_id} to reach {statuses}", every=0.2)


def _rows(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def _once(rows: list[dict], n: int) -> dict[str, dict]:
    """The rows by custom_id, having checked that each of the n custom_ids is there exactly once."""
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)) == n, sorted(ids)
    return {r["custom_id"]: r for r in rows}


@pytest.mark.each_broker
def test_the_openai_client_runs_a_batch_from_upload_to_results(stack):
    client = _client(stack.api_url)
    lines = [_line(f"q{i}", _chat(f"question {i}")) for i in range(6)]
    lines += [_line("too-long", _chat("x", max_tokens=100_000)), _line("no-model", _chat("x", model="nope"))]
    b = _submit(client, lines)
    assert b.status == "validating" and b.endpoint == CHAT
    b = _wait(client, b.id)
    assert b.status == "completed" and b.completed_at and b.in_progress_at and b.finalizing_at
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (8, 6, 2)
    out, err = _rows(client, b.output_file_id), _rows(client, b.error_file_id)
    rows = _once(out + err, 8)
    for i in range(6):
        body = rows[f"q{i}"]["response"]["body"]
        assert rows[f"q{i}"]["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] >= 1
    assert (rows["too-long"]["response"]["status_code"], rows["too-long"]["error"]["code"]) == (400, "limit_exceeded")
    assert (rows["no-model"]["response"]["status_code"], rows["no-model"]["error"]["code"]) == (404, "model_not_found")
    assert b.usage.output_tokens == sum(rows[f"q{i}"]["response"]["body"]["usage"]["completion_tokens"] for i in range(6))
    meta = client.files.retrieve(b.output_file_id)
    assert meta.purpose == "batch_output" and meta.bytes == len(client.files.content(b.output_file_id).content)
    assert b.id in [x.id for x in client.batches.list(limit=100)]
    metrics = httpx.get(f"{stack.api_url}/metrics", timeout=10).text
    assert 'llmpipe_batch_lines_total{model="' in metrics and 'llmpipe_batches{status="completed"}' in metrics


def test_a_batch_line_answers_the_body_the_endpoint_answers(stack):
    client = _client(stack.api_url)
    chat = _chat("What is the capital of France?", max_tokens=12, ignore_eos=True)
    comp = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    for endpoint, body in ((CHAT, chat), ("/v1/completions", comp)):
        sync = httpx.post(f"{stack.api_url}{endpoint}", json=body, timeout=60).json()
        b = _wait(client, _submit(client, [_line("x", body, endpoint), _line("y", body, endpoint)], endpoint).id)
        rows = _once(_rows(client, b.output_file_id), 2)
        for row in rows.values():
            got = row["response"]["body"]
            assert {k: v for k, v in got.items() if k not in ("id", "created")} == \
                {k: v for k, v in sync.items() if k not in ("id", "created")}, endpoint


def test_a_cancel_stops_feeding_aborts_what_runs_and_keeps_what_finished(stack):
    client = _client(stack.api_url)
    r = redis.Redis.from_url(stack.s.redis_url)
    n = 100
    b = _submit(client, [_line(f"c{i}", _chat(f"c{i}", max_tokens=64, ignore_eos=True)) for i in range(n)])
    _wait(client, b.id, pred=lambda x: x.request_counts.completed >= 1)
    c = client.batches.cancel(b.id)
    assert c.status == "cancelling" and c.cancelling_at
    b = _wait(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    out, err = _rows(client, b.output_file_id), _rows(client, b.error_file_id)
    _once(out + err, n)
    assert len(out) == b.request_counts.completed >= 1 and len(err) == b.request_counts.failed >= 1
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
    # nothing of it is left to run: every job of the batch has ended, those cut short as cancelled
    jobs = [r.hgetall(k) for k in r.scan_iter(f"llmpipe:job:{b.id}-*")]
    assert {j[b"status"] for j in jobs} <= {b"succeeded", b"cancelled"} and b"cancelled" in {j[b"status"] for j in jobs}


# -- a stack of this module's own: two API processes, one of them killed ----------------------
@pytest.fixture(scope="module")
def two_apis(tmp_path_factory, redis_server, tiny_model):
    """vLLM on the tiny model with two API processes on one Redis, short batch leases."""
    redis.Redis.from_url(redis_server.url).flushdb()
    p = start_pipeline(tmp_path_factory.mktemp("pipe-batch-takeover"), redis_server.url, tiny_model, "vllm",
                       flower=False, batch_lease_ttl_s=3.0, batch_scan_interval_s=0.2)
    port = free_port()
    p.sup.spawn("api2", [sys.executable, "-m", "llmpipe.cli", "api", "--host", "127.0.0.1", "--port", str(port)], p.env)
    wait_until(lambda: _answers(f"http://127.0.0.1:{port}"), 60, "the second API")
    yield p, f"http://127.0.0.1:{port}"
    teardown(p)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_an_api_process_killed_mid_batch_is_taken_over_and_every_line_lands_once(two_apis):
    p, url2 = two_apis
    client = _client(p.api_url)
    r = redis.Redis.from_url(p.s.redis_url)
    n = 60
    b = _submit(client, [_line(f"k{i}", _chat(f"k{i}", max_tokens=32, ignore_eos=True)) for i in range(n)])
    b = _wait(client, b.id, pred=lambda x: x.request_counts.completed >= 5)
    leases = BatchLeases(r, ttl_s=3.0)
    holder = leases.holder(b.id)
    pids = {c.proc.pid: c.name for c in p.sup.children if c.name in ("api", "api2")}
    assert owner_pid(holder) in pids, (holder, pids)
    os.kill(owner_pid(holder), signal.SIGKILL)  # the feeding API process dies mid-batch
    survivor = _client(url2 if pids[owner_pid(holder)] == "api" else p.api_url)
    b = _wait(survivor, b.id)
    assert b.status == "completed"
    # The survivor finished it and lets go: its feeder releases the lease after writing the end
    # (only a release clears the holder; a lapsed lease keeps it).
    wait_until(lambda: leases.holder(b.id) is None, 30, "the survivor to release the batch's lease")
    assert (b.request_counts.completed, b.request_counts.failed) == (n, 0) and b.completed_at
    _once(_rows(survivor, b.output_file_id), n)
    assert _rows(survivor, b.error_file_id) == []
    # each line ran as one job: the survivor attached to the jobs the dead process had made
    jobs = sorted(k.decode() for k in r.scan_iter(f"llmpipe:job:{b.id}-*"))
    assert len(jobs) == n and all(k.endswith("-a0") for k in jobs)


# -- an API with no workers: nothing it feeds can finish --------------------------------------
@pytest.fixture(scope="module")
def api_only(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("pipe-batch-api-only")
    server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
    s = pipeline_settings(tmp, server.url, tiny_model, "vllm", batch_scan_interval_s=0.2)
    p = LocalPipeline(s, kinds=()).start()
    try:
        p.wait_ready(timeout=60)
        yield p
    finally:
        teardown(p)
        server.stop()


def test_the_window_passing_ends_the_batch_expired_with_every_line_in_the_error_file(api_only):
    client = _client(api_only.api_url)
    r = redis.Redis.from_url(api_only.s.redis_url)
    b = _submit(client, [_line(f"e{i}", _chat(f"e{i}")) for i in range(5)], window="2s")
    b = _wait(client, b.id, timeout=60)
    assert b.status == "expired" and b.expired_at and b.output_file_id is None
    rows = _once(_rows(client, b.error_file_id), 5)
    assert {x["error"]["code"] for x in rows.values()} == {"batch_expired"}
    assert all(x["response"] is None for x in rows.values())
    jobs = [r.hget(k, "status") for k in r.scan_iter(f"llmpipe:job:{b.id}-*")]
    assert jobs and set(jobs) == {b"cancelled"}  # the lines it had fed were stopped


def test_a_file_that_fails_validation_runs_nothing(api_only):
    client = _client(api_only.api_url)
    r = redis.Redis.from_url(api_only.s.redis_url)
    b = _submit(client, [_line("a", _chat("a")), _line("a", _chat("b")), {"custom_id": "m", "method": "GET",
                                                                          "url": CHAT, "body": {}}])
    b = _wait(client, b.id, timeout=60)
    assert b.status == "failed" and [(e.code, e.line) for e in b.errors.data] == [("duplicate_custom_id", 2),
                                                                                   ("invalid_method", 3)]
    assert list(r.scan_iter(f"llmpipe:job:{b.id}-*")) == []


def test_the_cli_submits_waits_and_writes_the_results(stack, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(_line(f"cli{i}", _chat(f"cli {i}"))) + "\n" for i in range(3)))
    cli = [sys.executable, "-m", "llmpipe.cli", "batch"]
    env = {**os.environ, "LLMPIPE_URL": stack.api_url}
    sub = subprocess.run([*cli, "submit", str(inp), "--wait"], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert sub.returncode == 0, sub.stderr
    batch_id = sub.stdout.split()[0]
    assert "completed (3 completed, 0 failed of 3)" in sub.stderr
    status = subprocess.run([*cli, "status", batch_id], env=env, capture_output=True, text=True, check=True)
    assert status.stdout.startswith(f"batch {batch_id}: completed")
    out = tmp_path / "out.jsonl"
    subprocess.run([*cli, "results", batch_id, "--out", str(out)], env=env, check=True, timeout=60)
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == ["cli0", "cli1", "cli2"]
    errs = subprocess.run([*cli, "results", batch_id, "--errors"], env=env, capture_output=True, text=True, check=False)
    assert errs.returncode == 1 and "has no error file" in errs.stderr
