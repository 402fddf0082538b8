"""Feeding a batch (api/batches/feeder.py) against a real Redis and the real job service, with
the workers played by the test: it finishes (or expires) the lines' job records as the chord
callback would. Fake clocks for the completion window and the lease."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from api.batches.feeder import BatchFeeder, LeaseLost
from api.batches.protocol import BatchCreate
from llmpipe.batches.files import output_file_ids
from llmpipe.batches.lease import BatchLeases
from llmpipe.batches.records import BatchStatus
from llmpipe.jobs.lanes import queue_keys
from llmpipe.jobs.store import JobStore
from llmpipe.messages import JobResult, JobStatus
from llmpipe.settings import Settings
from tests.harness.clock import ManualClock

URL = "/v1/chat/completions"


class Stack:
    """An app's collaborators (no lifespan: the test runs the feeders) and the fake workers."""

    def __init__(self, redis_client, redis_url, tmp_path, **overrides):
        from api.app import create_app

        s = Settings(redis_url=redis_url, state_dir=tmp_path, batch_feeder=False, max_tokens_limit=100,
                     **{"batch_max_in_flight": 3, **overrides})
        self.st = create_app(s).state
        self.r = redis_client
        self.jobs = JobStore(redis_client, 3600)
        self.now = ManualClock(self.st.batches._clock())
        self.lease_now = ManualClock(1000.0)

    def batch(self, n: int, window: str = "1h") -> str:
        fs = self.st.files
        fid = "file-" + "0" * 31 + "1"
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": URL,
                  "body": {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4}} for i in range(n)]
        fs.path(fid).parent.mkdir(parents=True, exist_ok=True)
        fs.path(fid).write_text("".join(json.dumps(x) + "\n" for x in lines))
        fs.record(fid, fs.path(fid).stat().st_size, "in.jsonl", "batch")
        return self.st.batch_api.create(BatchCreate(input_file_id=fid, endpoint=URL, completion_window=window)).id

    def feeder(self, batch_id: str, owner: str = "host:1:a") -> BatchFeeder:
        leases = BatchLeases(self.r, ttl_s=10.0, owner=owner, clock=self.lease_now)
        env = dataclasses.replace(self.st.feed_env, clock=self.now, leases=leases)
        f = BatchFeeder(env, batch_id, tick_s=0.05)
        return f

    # -- the workers' part ----------------------------------------------------------------
    def job_ids(self, batch_id: str, status: tuple[str, ...] = ("queued", "running")) -> list[str]:
        keys = sorted(k.decode() for k in self.r.scan_iter(f"llmpipe:job:{batch_id}-*"))
        return [k.removeprefix("llmpipe:job:") for k in keys if self.r.hget(k, "status").decode() in status]

    def finish(self, job_id: str) -> None:
        res = JobResult.model_validate({
            "job_id": job_id, "status": "succeeded", "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            "results": [{"index": 0, "text": f"answer to {job_id}", "finish_reason": "stop", "prompt_tokens": 5,
                         "completion_tokens": 2}]})
        assert self.jobs.finish(res)
        for key in queue_keys("preprocess"):  # the worker took its message
            if self.r.rpop(key) is not None:
                break

    def messages(self) -> int:
        return sum(self.r.llen(k) for k in queue_keys("preprocess"))

    def record(self, batch_id: str):
        return self.st.batches.get(batch_id)

    def lines(self, batch_id: str, which: int) -> list[dict]:
        path = self.st.files.path(output_file_ids(batch_id)[which])
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _append(path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


async def until(pred, timeout: float = 20.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.fixture
def stack(redis_client, redis_url, tmp_path):
    s = Stack(redis_client, redis_url, tmp_path)
    yield s
    s.st.batch_pool.shutdown(wait=False)


def _run(stack: Stack, coro):
    """Run ``coro``, then close the app's waiter, as the app's lifespan does."""
    async def main():
        try:
            return await coro
        finally:
            await stack.st.waiter.close()
    return asyncio.run(main())


def test_lines_run_in_a_bounded_window_and_each_lands_once(stack):
    bid = stack.batch(8)
    f = stack.feeder(bid)
    assert f.env.leases.acquire(bid).ok
    peak = []

    async def workers():
        for left in range(8, 0, -1):
            await until(lambda left=left: len(stack.job_ids(bid)) == min(3, left))
            peak.append(len(stack.job_ids(bid)))
            stack.finish(stack.job_ids(bid)[0])

    async def main():
        return await asyncio.gather(f.run(), workers())

    ended, _ = _run(stack, main())
    assert ended is BatchStatus.COMPLETED and max(peak) == 3
    rec = stack.record(bid)
    assert (rec.total, rec.completed, rec.failed, rec.output_file_id, rec.error_file_id) == \
        (8, 8, 0, output_file_ids(bid)[0], None)
    assert (rec.input_tokens, rec.output_tokens) == (40, 16) and {"in_progress_at", "finalizing_at", "completed_at"} <= set(rec.times)
    out = stack.lines(bid, 0)
    assert sorted(x["custom_id"] for x in out) == sorted(f"c{i}" for i in range(8))
    first = next(x for x in out if x["custom_id"] == "c0")
    assert first["response"]["status_code"] == 200 and first["error"] is None
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == f"answer to {bid}-l0-a0"
    assert first["response"]["request_id"] == f"{bid}-l0-a0"
    assert stack.st.files.get(rec.output_file_id).purpose == "batch_output"
    assert bid not in stack.st.batches.active()


def test_a_429_halves_the_window_and_the_refused_lines_are_sent_again(redis_client, redis_url, tmp_path):
    # The batch lane may hold int(2 * 0.5) = 1 message in a stage queue: a second line is refused.
    stack = Stack(redis_client, redis_url, tmp_path, max_queue_depth=2, batch_max_in_flight=4)
    bid = stack.batch(3)
    f = stack.feeder(bid)
    f.env.leases.acquire(bid)
    seen = []

    async def workers():
        for _ in range(3):
            # the job's record and its message (the record is made first): the worker takes the message
            await until(lambda: len(stack.job_ids(bid)) == 1 and stack.messages() == 1)
            seen.append(len(stack.job_ids(bid)))
            await until(lambda: f.aimd.cuts >= 1)
            stack.finish(stack.job_ids(bid)[0])

    async def main():
        return await asyncio.gather(f.run(), workers())

    ended, _ = _run(stack, main())
    assert ended is BatchStatus.COMPLETED and seen == [1, 1, 1]
    assert f.aimd.cuts >= 1 and f.aimd.window < 4
    assert len(stack.lines(bid, 0)) == 3 and stack.record(bid).completed == 3
    stack.st.batch_pool.shutdown(wait=False)


@pytest.mark.parametrize("how", ["expire", "cancel"])
def test_the_window_passing_or_a_cancel_stops_it_with_what_finished(stack, how):
    bid = stack.batch(5)
    f = stack.feeder(bid)
    f.env.leases.acquire(bid)
    rec = stack.record(bid)
    in_flight = []

    async def workers():
        await until(lambda: len(stack.job_ids(bid)) == 3)
        stack.finish(stack.job_ids(bid)[0])
        await until(lambda: stack.record(bid).completed == 1 and len(stack.job_ids(bid)) == 3)
        in_flight.extend(stack.job_ids(bid))
        if how == "expire":
            stack.now.t = rec.expires_at  # the completion window has passed
        else:
            assert stack.st.batches.cancel(bid)

    async def main():
        return await asyncio.gather(f.run(), workers())

    ended, _ = _run(stack, main())
    code = {"expire": "batch_expired", "cancel": "batch_cancelled"}[how]
    assert ended is {"expire": BatchStatus.EXPIRED, "cancel": BatchStatus.CANCELLED}[how]
    rec = stack.record(bid)
    assert (rec.completed, rec.failed) == (1, 4) and rec.status is ended
    out, err = stack.lines(bid, 0), stack.lines(bid, 1)
    assert len(out) == 1 and sorted(x["custom_id"] for x in out + err) == [f"c{i}" for i in range(5)]
    assert {x["error"]["code"] for x in err} == {code} and all(x["response"] is None for x in err)
    # the lines in flight were stopped: their jobs cancelled (their engine requests aborted)
    assert all(stack.jobs.get(j).status is JobStatus.CANCELLED for j in in_flight)
    assert stack.job_ids(bid) == []


def test_a_job_that_expired_in_the_queues_runs_again(stack):
    bid = stack.batch(1)
    f = stack.feeder(bid)
    f.env.leases.acquire(bid)

    async def workers():
        await until(lambda: stack.job_ids(bid) == [f"{bid}-l0-a0"])
        stack.jobs.stop(f"{bid}-l0-a0", JobStatus.EXPIRED, {"type": "expired", "message": "deadline passed"})
        await until(lambda: stack.job_ids(bid) == [f"{bid}-l0-a1"])
        assert stack.st.batches.attempts(bid) == {0: 1}
        stack.finish(f"{bid}-l0-a1")

    async def main():
        return await asyncio.gather(f.run(), workers())

    ended, _ = _run(stack, main())
    [line] = stack.lines(bid, 0)
    assert ended is BatchStatus.COMPLETED and line["response"]["request_id"] == f"{bid}-l0-a1"


def test_a_takeover_finishes_the_batch_with_every_line_once(stack):
    bid = stack.batch(6)
    a, b = stack.feeder(bid, "host:1:a"), stack.feeder(bid, "host:2:b")
    assert a.env.leases.acquire(bid).ok

    async def main():
        task = asyncio.create_task(a.run())
        await until(lambda: len(stack.job_ids(bid)) == 3)
        for j in stack.job_ids(bid)[:2]:
            stack.finish(j)
        await until(lambda: stack.record(bid).completed == 2 and len(stack.job_ids(bid)) == 3)
        left_running = stack.job_ids(bid)
        task.cancel()  # a dies: no release, no renewal; its jobs go on
        with pytest.raises(asyncio.CancelledError):
            await task
        out_path = stack.st.files.path(output_file_ids(bid)[0])
        _append(out_path, b'{"id": "batch_req_x", "custom_id": "c5", "resp')  # and its last write was torn
        assert not b.env.leases.acquire(bid).ok
        stack.lease_now.t += 10.5  # a's lease lapses
        assert b.env.leases.acquire(bid).other == "host:1:a"
        run_b = asyncio.create_task(b.run())
        for j in left_running:  # the jobs a left running finish: b collects them, makes none again
            stack.finish(j)
        await until(lambda: len(stack.job_ids(bid)) == 1)
        stack.finish(stack.job_ids(bid)[0])
        return await run_b, left_running

    ended, left_running = _run(stack, main())
    assert ended is BatchStatus.COMPLETED
    out = stack.lines(bid, 0)
    assert sorted(x["custom_id"] for x in out) == [f"c{i}" for i in range(6)]
    assert {x["response"]["request_id"] for x in out} >= set(left_running)
    assert len(stack.job_ids(bid, ("succeeded", "queued", "running", "cancelled", "failed", "expired"))) == 6
    assert stack.record(bid).completed == 6


def test_a_holder_that_lost_its_lease_writes_nothing(stack):
    bid = stack.batch(2)
    a, b = stack.feeder(bid, "host:1:a"), stack.feeder(bid, "host:2:b")
    a.env.leases.acquire(bid)

    async def main():
        task = asyncio.create_task(a.run())
        await until(lambda: len(stack.job_ids(bid)) == 2)
        stack.lease_now.t += 11  # a stalled past its lease; b took the batch
        assert b.env.leases.acquire(bid).ok
        stack.finish(stack.job_ids(bid)[0])
        with pytest.raises(LeaseLost):
            await task

    _run(stack, main())
    assert stack.lines(bid, 0) == [] and stack.record(bid).completed == 0


def test_runners_take_over_a_batch_whose_holder_stopped_renewing(stack):
    from api.batches.runner import BatchRunner

    bid = stack.batch(3)
    runners = [BatchRunner(dataclasses.replace(stack.feeder(bid, owner).env), scan_s=0.05)
               for owner in ("host:1:a", "host:2:b")]
    a, b = runners

    async def main():
        assert await a.scan() == [bid] and await b.scan() == []
        await until(lambda: len(stack.job_ids(bid)) == 3)  # a feeds it
        stack.lease_now.t += 5
        assert await a.renew() == [] and await b.scan() == []  # a renews: b cannot take it
        stack.lease_now.t += 10.5  # a stalls past its lease
        assert await b.scan() == [bid]
        assert await a.renew() == [bid] and bid not in a.feeders  # a learns it lost it, and stops
        for j in stack.job_ids(bid):
            stack.finish(j)  # b collects the jobs a made
        await until(lambda: stack.record(bid).status is BatchStatus.COMPLETED)
        await until(lambda: bid not in b.feeders)
        await a.close()
        await b.close()

    _run(stack, main())
    assert len(stack.lines(bid, 0)) == 3 and stack.r.hget(f"llmpipe:batch-lease:{bid}", "holder") is None
