"""The test-only fault injector's runtime holds (llmpipe/testing/faulty.py), on real Redis."""

from __future__ import annotations

import pytest

from llmpipe.testing.faulty import DELAYS_KEY, _hold, _runtime_delay


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
