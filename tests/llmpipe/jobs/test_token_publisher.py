"""The token publisher's order (llmpipe/jobs/streaming.py): a request's entries reach Redis in
the order they were taken, its last one before ``finish`` returns, which the job's end
marker (written after it) relies on: the SSE reader stops at the marker."""

from __future__ import annotations

import json
import threading

from llmpipe.jobs.streaming import TokenPublisher, stream_key

THREAD = "llmpipe-token-publisher"


class GatedRedis:
    """A Redis client whose pipelines, when the publisher's thread runs them, wait at a gate
    until the test opens it; ``entered`` is set when one reaches the gate."""

    def __init__(self, r):
        self.r = r
        self.entered = threading.Event()
        self.opened = threading.Event()

    def pipeline(self, **kw):
        pipe = self.r.pipeline(**kw)
        if threading.current_thread().name == THREAD:
            run = pipe.execute

            def execute():
                self.entered.set()
                assert self.opened.wait(30)
                return run()

            pipe.execute = execute
        return pipe


def _published(r, job_id: str) -> list[tuple[int, list[int]]]:
    return [(int(f[b"o"]), json.loads(f[b"d"])) for _, f in r.xrange(stream_key(job_id))]


def test_finish_returns_once_the_publishers_thread_wrote_the_last_entry(redis_client):
    gate = GatedRedis(redis_client)
    pub = TokenPublisher(gate, flush_s=60, partial_every_s=60)
    try:
        pub.register("j-0", "j", 0, True)
        finisher = threading.Thread(target=pub.finish, args=("j-0", [1, 2, 3]))
        finisher.start()
        assert gate.entered.wait(10), "the publisher's thread writes the last entry"
        assert finisher.is_alive() and _published(redis_client, "j") == []  # finish waits for the write
        gate.opened.set()
        finisher.join(10)
        assert not finisher.is_alive()
        assert _published(redis_client, "j") == [(0, [1, 2, 3])]
    finally:
        gate.opened.set()
        pub.close()


def test_the_last_entry_follows_one_under_way(redis_client):
    """A stream's first ids go out at once; while that write is under way, the request ends:
    its last entry lands after the first, and finish returns after both."""
    gate = GatedRedis(redis_client)
    pub = TokenPublisher(gate, flush_s=60, partial_every_s=60)
    try:
        pub.register("j-0", "k", 0, True)
        pub.on_tokens("j-0", [1])
        assert gate.entered.wait(10)  # the first entry is being written
        pub.on_tokens("j-0", [1, 2, 3])
        finisher = threading.Thread(target=pub.finish, args=("j-0", [1, 2, 3, 4]))
        finisher.start()
        assert finisher.is_alive()
        gate.opened.set()
        finisher.join(10)
        assert not finisher.is_alive()
        assert _published(redis_client, "k") == [(0, [1]), (1, [2, 3, 4])]
    finally:
        gate.opened.set()
        pub.close()


def test_a_request_that_does_not_stream_finishes_without_a_write(redis_client):
    """Nobody reads its end from the stream: finish drops it at once."""
    gate = GatedRedis(redis_client)
    pub = TokenPublisher(gate, flush_s=60, partial_every_s=60)
    try:
        pub.register("j-0", "n", 0, False)
        pub.on_tokens("j-0", [1, 2])
        pub.finish("j-0", [1, 2, 3])
        assert not gate.entered.is_set() and _published(redis_client, "n") == []
    finally:
        gate.opened.set()
        pub.close()
