"""Cancellation reaches running jobs by broadcast and, when that is missed, by the durable
flag (llmpipe/jobs/cancel.py), on real Redis."""

from __future__ import annotations

import threading
import time

from llmpipe.jobs.cancel import CHANNEL, CancelListener, cancel_key, request_cancel


class Seen:
    def __init__(self):
        self.ids, self.event = [], threading.Event()

    def __call__(self, job_id: str) -> None:
        self.ids.append(job_id)
        self.event.set()


def test_a_sweep_reports_the_running_jobs_whose_flag_is_set(redis_client):
    redis_client.set(cancel_key("gone"), 1, ex=60)
    seen = Seen()
    listener = CancelListener(redis_client, seen, lambda: ["gone", "alive"], sweep_every_s=3600)
    try:
        assert listener.sweep() == ["gone"]
        assert set(seen.ids) == {"gone"}
    finally:
        listener.close()


def test_a_cancel_whose_broadcast_was_missed_still_reaches_the_running_job(redis_client):
    # The flag is set and nothing is published: as when the broadcast went out while the
    # subscription was down. The periodic sweep finds it.
    seen = Seen()
    running = ["late"]
    listener = CancelListener(redis_client, seen, lambda: list(running))  # the shipped 1 s sweep
    try:
        redis_client.set(cancel_key("late"), 1, ex=60)
        assert seen.event.wait(5), "the sweep did not report a flagged running job"
        assert seen.ids[0] == "late"
    finally:
        listener.close()


def test_the_broadcast_reaches_the_listener_without_waiting_for_a_sweep(redis_client):
    seen = Seen()
    listener = CancelListener(redis_client, seen, lambda: [], sweep_every_s=3600)
    try:
        end = time.monotonic() + 5
        while redis_client.pubsub_numsub(CHANNEL)[0][1] < 1 and time.monotonic() < end:
            time.sleep(0.01)
        request_cancel(redis_client, "fast", ttl_s=60)
        assert seen.event.wait(5) and seen.ids == ["fast"]
    finally:
        listener.close()
