"""The test-only fault injector's runtime holds (llmpipe/testing/faulty.py), on real Redis."""

from __future__ import annotations

import pytest

from llmpipe.engines.base import EngineOutput, EngineRequest
from llmpipe.engines.noop import NoopEngine
from llmpipe.messages import FinishReason, SamplingParams
from llmpipe.testing import faulty
from llmpipe.testing.faulty import DELAYS_KEY, FaultInjectingEngine, FaultSpec, _hold, _runtime_delay


class _Clock:
    """A fake clock whose sleep moves time; ``on_sleep`` runs after each sleep."""

    def __init__(self, on_sleep=None):
        self.t, self.slept, self.on_sleep = 0.0, 0, on_sleep

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s
        self.slept += 1
        if self.on_sleep is not None:
            self.on_sleep(self)


def test_a_hold_ends_when_the_test_clears_it(redis_client):
    redis_client.hset(DELAYS_KEY, "batch", 60)

    def clear_after_a_second(clock):
        if clock.t >= 1.0:
            redis_client.delete(DELAYS_KEY)

    clock = _Clock(clear_after_a_second)
    _hold(redis_client, "batch", _runtime_delay(redis_client, "batch"), clock=clock, sleep=clock.sleep)
    assert 1.0 <= clock.t < 1.2  # released by the clear (checked every 0.05 s), not at 60 s


def test_a_hold_runs_out_on_its_own(redis_client):
    redis_client.hset(DELAYS_KEY, "llmpipe.preprocess", 0.2)
    try:
        clock = _Clock()
        _hold(redis_client, "llmpipe.preprocess", _runtime_delay(redis_client, "llmpipe.preprocess"),
              clock=clock, sleep=clock.sleep)
        assert clock.t == pytest.approx(0.2) and clock.slept == 4
    finally:
        redis_client.delete(DELAYS_KEY)


def test_no_hold_without_a_delay(redis_client):
    clock = _Clock()
    _hold(redis_client, "batch", _runtime_delay(redis_client, "batch"), clock=clock, sleep=clock.sleep)
    assert clock.slept == 0


class _FlakyRedis:
    """Fails its first ``n`` reads, as a Redis connection that was dropped does."""

    def __init__(self, n: int, value: bytes | None):
        self.n, self.value, self.calls = n, value, 0

    def hget(self, key, field):
        self.calls += 1
        if self.calls <= self.n:
            raise ConnectionError("Connection closed by server.")
        return self.value


def test_a_failed_read_of_the_delay_is_tried_again():
    r = _FlakyRedis(2, b"2.5")
    assert _runtime_delay(r, "batch") == 2.5
    assert r.calls == 3


def test_no_delay_when_redis_never_answers():
    assert _runtime_delay(_FlakyRedis(10, b"2.5"), "batch") == 0.0
    assert _runtime_delay(None, "batch") == 0.0


class _Streaming(NoopEngine):
    """Hands each request's tokens on one at a time, as a real engine's steps do."""

    def generate(self, batch, on_tokens=None):
        for step in range(1, 5):
            for r in batch:
                on_tokens(r.request_id, [7] * step)
        return [EngineOutput(r.request_id, [7] * 4, FinishReason.LENGTH) for r in batch]


def test_each_request_holds_once_right_after_its_nth_token_is_handed_on(redis_client, monkeypatch):
    redis_client.hset(DELAYS_KEY, "tokens", 60)
    handed: list[tuple[str, int]] = []
    holds: list[tuple[str, float, list]] = []
    monkeypatch.setattr(faulty, "_hold", lambda r, name, s: holds.append((name, s, list(handed))))
    eng = FaultInjectingEngine(_Streaming(), FaultSpec(hold_at_tokens=2), lambda ids: "", redis_client)
    reqs = [EngineRequest(f"r{i}", [5], SamplingParams(max_tokens=4)) for i in range(2)]
    try:
        eng.generate(reqs, lambda rid, ids: handed.append((rid, len(ids))))
    finally:
        redis_client.delete(DELAYS_KEY)
    # the batch's own hold first (none set), then one "tokens" hold per request, each right
    # after that request's second token was handed on, and none at its later tokens
    assert [(n, s) for n, s, _ in holds] == [("batch", 0.0), ("tokens", 60.0), ("tokens", 60.0)]
    assert holds[1][2][-1] == ("r0", 2) and holds[2][2][-1] == ("r1", 2)
    assert len(handed) == 8


def test_no_token_hold_unless_asked(redis_client, monkeypatch):
    holds: list[str] = []
    monkeypatch.setattr(faulty, "_hold", lambda r, name, s: holds.append(name))
    eng = FaultInjectingEngine(_Streaming(), FaultSpec(), lambda ids: "", redis_client)
    eng.generate([EngineRequest("r0", [5], SamplingParams(max_tokens=4))], lambda rid, ids: None)
    assert holds == ["batch"]
