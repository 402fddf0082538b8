"""Redis high availability: the master dies (kill -9) under load, Sentinel promotes the
replica, and the stack follows by itself.

Layout, each on its own host (network namespace): the master, its replica, three
sentinels, the API, the CPU workers, one inference worker (the SIMULATED engine: it sleeps,
so the test costs little CPU) and the client. Every process is given the same
``sentinel://`` URL. Sentinel timings are test ones (a master silent for 1 s is down); the
job timeout (a request field, not a setting) is short so that a job whose messages died
with the master is settled by the watchdog within the test.

Checked: no 500 at any time, and 503 while no master exists; every accepted job ends
(terminal) or its record is gone with the master (replication is asynchronous), and only
jobs accepted just before the kill may be lost; jobs accepted after the promotion succeed.
The counts are printed (docs/reliability.md, "Redis failover (Sentinel)").
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import httpx
import pytest

from llmpipe.bench.modes import BASE_ENV
from llmpipe.settings import EngineKind, Settings
from llmpipe.testing.hosts import netns

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))]

JOB_TIMEOUT_S = 20.0
SUBMIT_EVERY_S = 0.05
TERMINAL = ("succeeded", "failed", "expired", "cancelled")


class Load:
    """Closed-loop submits from the client host, with a /healthz probe between them; each
    answer is kept with when its request started and ended."""

    def __init__(self, api_url: str):
        self.api_url = api_url
        self.stop = threading.Event()
        self.accepted: list[tuple[str, float]] = []  # (job id, when the 202 came)
        self.answers: list[tuple[str, float, float, int | str, str]] = []  # path, start, end, status, body

    def _one(self, c: httpx.Client, method: str, path: str, **kw) -> httpx.Response | None:
        t0 = time.time()
        try:
            r = c.request(method, path, **kw)
        except httpx.HTTPError as exc:
            self.answers.append((path, t0, time.time(), type(exc).__name__, ""))
            return None
        self.answers.append((path, t0, time.time(), r.status_code, r.text[:300]))
        return r

    def run(self) -> None:
        i = 0
        with httpx.Client(base_url=self.api_url, timeout=30) as c:
            while not self.stop.is_set():
                body = {"prompt": f"failover {i}", "max_tokens": 8, "ignore_eos": True, "timeout": JOB_TIMEOUT_S}
                r = self._one(c, "POST", "/v1/jobs", json=body)
                if r is not None and r.status_code == 202:
                    self.accepted.append((r.json()["id"], time.time()))
                self._one(c, "GET", "/healthz")
                i += 1
                time.sleep(SUBMIT_EVERY_S)


def _completions(api_url: str, model: str) -> float:
    """A waiting call and a streaming one (the API's pub/sub waiter and its token-stream
    reads, both asyncio clients of the Sentinel URL) end with their text; returns the
    seconds both took."""
    t0 = time.monotonic()
    body = {"model": model, "prompt": "after failover", "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=api_url, timeout=60) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and any('"finish_reason":"length"' in ln for ln in lines), lines[-3:]
    return time.monotonic() - t0


def _settle(api_url: str, ids: list[str], timeout: float) -> dict[str, str]:
    """Each job's terminal status, or "lost" when the API no longer knows it (404): its
    record did not reach the replica before the master died."""
    out: dict[str, str] = {}
    pending = list(ids)
    end = time.monotonic() + timeout
    with httpx.Client(base_url=api_url, timeout=10) as c:
        while pending and time.monotonic() < end:
            still = []
            for j in pending:
                r = c.get(f"/v1/jobs/{j}")
                if r.status_code == 404:
                    out[j] = "lost"
                elif r.status_code == 200 and r.json()["status"] in TERMINAL:
                    out[j] = r.json()["status"]
                else:
                    still.append(j)
            pending = still
            if pending:
                time.sleep(0.3)
    assert not pending, f"{len(pending)} of {len(ids)} jobs not terminal after {timeout:.0f}s: {pending[:5]}"
    return out


@pytest.mark.timeout(400)
def test_the_master_dies_under_load_and_the_stack_follows_the_promoted_replica(hosts, tmp_path, tiny_model):
    from llmpipe.testing.hosts.pipeline import HostsPipeline, Placement
    from llmpipe.testing.hosts.sentinel import SentinelGroup

    t_start = time.monotonic()
    group = SentinelGroup(hosts, master="redis1", replicas=("redis2",), sentinels=("sent1", "sent2", "sent3")).start()
    settings = Settings(redis_url=group.url, model=tiny_model, engine=EngineKind.SIMULATED, state_dir=tmp_path / "state",
                        max_batch_size=8, max_model_len=256, cpu_workers=1)
    hp = HostsPipeline(settings, hosts, Placement("redis1", "api", "cpu", ("gpu1",), "client"), extra_env=dict(BASE_ENV),
                       redis_url=group.url).start(1)
    hp.wait_ready(timeout=240)
    t_ready = time.monotonic()

    # The waiter's one pub/sub connection is up (to the first master) before the kill.
    hosts.call("client", _completions, hp.api_url, settings.model)
    load = Load(hp.api_url)
    runner = hosts.executor("client").submit(load.run)
    try:
        deadline = time.monotonic() + 30
        while len(load.accepted) < 30:  # load is flowing through the whole stack
            assert time.monotonic() < deadline and not runner.done(), load.answers[-3:]
            time.sleep(0.1)
        old = group.initial_master
        t_kill = time.time()
        killed = hosts.kill_host("redis1")  # kill -9: no shutdown, no last write
        assert killed
        # Asked from a sentinel's host: the client host's one thread runs the load.
        new, t_no_master = group.wait_promoted("sent1", old=old, timeout=60)
        t_promoted = time.time()
        assert group.host_of(new) == "redis2", new
        # The stack answers again by itself: jobs accepted after the promotion run end to end.
        deadline = time.monotonic() + 60
        while not [j for j, at in load.accepted if at > t_promoted + 1]:
            assert time.monotonic() < deadline and not runner.done(), load.answers[-3:]
            time.sleep(0.1)
        t_back = next(at for _, at in load.accepted if at > t_promoted)
        time.sleep(5)  # load after the failover
    finally:
        load.stop.set()
        runner.result(timeout=60)

    statuses = hosts.call("client", _settle, hp.api_url, [j for j, _ in load.accepted],
                          JOB_TIMEOUT_S + settings.watchdog_grace_s + settings.watchdog_interval_s + 20)
    counts = Counter(statuses.values())
    # The API's asyncio clients followed the promotion too: a waiting call would otherwise
    # sleep to its deadline (default_timeout_s, 120 s), not return in seconds.
    completions_s = hosts.call("client", _completions, hp.api_url, settings.model)
    assert completions_s < 15, completions_s
    accepted_at = dict(load.accepted)
    codes = Counter(str(a[3]) for a in load.answers)
    # Never a 500, nor a broken connection: Redis gone is 503, with the error schema.
    bad = [a for a in load.answers if not isinstance(a[3], int) or a[3] >= 500 and a[3] != 503]
    assert not bad, bad[:5]
    unavailable = [a for a in load.answers if a[3] == 503]
    assert unavailable and not [a for a in unavailable if '"type":"unavailable"' not in a[4]], \
        [a for a in unavailable if '"type":"unavailable"' not in a[4]][:3]
    # While no master existed (after the kill, before any sentinel named the replica), what
    # the API answered was 503: a request that both started and ended then was not served.
    in_window = [a for a in load.answers if a[1] > t_kill and a[2] < t_no_master]
    around = [(a[0], round(a[1] - t_kill, 2), round(a[2] - t_kill, 2), a[3]) for a in load.answers
              if a[2] > t_kill - 0.5 and a[1] < t_promoted + 0.5]
    assert in_window and all(a[3] == 503 for a in in_window), (round(t_no_master - t_kill, 2), around)
    # What the failover lost was accepted just before the kill (asynchronous replication):
    # nothing accepted once the promoted replica served.
    lost = [j for j, s in statuses.items() if s == "lost"]
    assert all(t_kill - 2.0 < accepted_at[j] < t_kill + 0.1 for j in lost), [(accepted_at[j] - t_kill) for j in lost]
    after = {j: statuses[j] for j, at in load.accepted if at > t_back}
    assert after and set(after.values()) == {"succeeded"}, Counter(after.values())
    not_ok = {j: s for j, s in statuses.items() if s not in ("succeeded", "lost")}
    assert all(t_kill - 5.0 < accepted_at[j] < t_back for j in not_ok), not_ok
    for kind in ("preprocess", "postprocess", "inference", "api"):
        assert all(c.proc.poll() is None for c in hp.roles[kind]), f"{kind} exited; logs in {hosts.log_dir}"

    row = {
        "scenario": "Redis master kill -9 under load, Sentinel failover", "accepted": len(load.accepted),
        "succeeded": counts["succeeded"], "expired": counts["expired"], "failed": counts["failed"],
        "lost": len(lost), "accepted_in_last_s_before_kill": sum(1 for _, at in load.accepted if t_kill - 1 < at <= t_kill),
        "no_master_s": round(t_no_master - t_kill, 2), "answers_while_no_master": len(in_window), "promoted_seen_s": round(t_promoted - t_kill, 2), "first_accept_after_kill_s": round(t_back - t_kill, 2),
        "http_codes": dict(codes), "completions_after_s": round(completions_s, 2), "startup_s": round(t_ready - t_start, 1), "wall_s": round(time.monotonic() - t_start, 1),
    }
    print("\nfailover:", json.dumps(row))
