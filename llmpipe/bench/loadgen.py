"""The load generator: async httpx clients, closed loop (N concurrent clients) or open loop
(Poisson arrivals at a rate).

Latency is the same for every mode: from sending the request to having the whole result
(the last byte of the final ``GET /v1/jobs/{id}?wait=`` answer, or of the OpenAI answer or
stream). Two client protocols:

* ``jobs``: ``POST /v1/jobs`` then ``GET status_url?wait=60`` until the job is terminal
  (the pipeline's API and the serial server). The result's per-prompt ``timings``,
  ``batch_size`` and ``engine_time_s`` give each request's engine interval.
* ``openai``: ``POST /v1/completions`` or ``/v1/chat/completions``, streamed or not
  (``vllm serve``, the pipeline's OpenAI API; llmpipe/bench/openai_client.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import random
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import httpx

TERMINAL = {"succeeded", "failed", "expired", "cancelled"}


@dataclass
class Sample:
    i: int
    start: float  # epoch seconds when the request was sent
    latency_s: float = 0.0
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    completion_tokens: int = 0
    batch_size: int | None = None
    engine_time_s: float | None = None
    engine_interval: tuple[float, float] | None = None  # epoch seconds, from the server's timings
    extra: dict = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.start + self.latency_s


def engine_interval(created_at: float, timings: dict, engine_time_s: float) -> tuple[float, float] | None:
    """When the engine ran this request, from the stage timings of a result.

    The job's ``created_at`` is when the first stage was enqueued; the stages follow each
    other (each one's enqueue time is the previous one's finish), so the inference stage
    ends at created_at + preprocess (wait + run) + inference (wait + run), and the engine
    ran for ``engine_time_s`` before that.
    """
    try:
        end = created_at
        for stage in ("preprocess", "inference"):
            end += timings[stage]["queue_wait_s"] + timings[stage]["run_s"]
    except (KeyError, TypeError):
        return None
    return (end - engine_time_s, end)


class JobsClient:
    protocol = "jobs"

    def __init__(self, base_url: str, max_tokens: int, *, job_timeout_s: float = 600.0):
        self.base = base_url.rstrip("/")
        self.max_tokens = max_tokens
        self.job_timeout_s = job_timeout_s

    def body(self, prompt: str) -> dict:
        return {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "timeout": self.job_timeout_s}

    async def request(self, http: httpx.AsyncClient, s: Sample, prompt: str) -> None:
        r = await http.post(f"{self.base}/v1/jobs", json=self.body(prompt))
        if r.status_code != 202:
            s.error = f"POST {r.status_code}: {r.text[:200]}"
            return
        url = self.base + r.json()["status_url"]
        while True:
            r = await http.get(url, params={"wait": 60})
            if r.status_code != 200:
                s.error = f"GET {r.status_code}: {r.text[:200]}"
                return
            view = r.json()
            if view.get("status") in TERMINAL:
                break
        if view["status"] != "succeeded" or not view.get("result"):
            s.error = f"job {view['status']}: {(view.get('error') or {}).get('message', '')[:200]}"
            return
        s.ok = True
        apply_view(s, view)
        s.completion_tokens = int(view["result"]["results"][0].get("completion_tokens", 0))


def apply_view(s: Sample, view: dict) -> None:
    """Take the server-side figures of a finished job: batch size, engine time and interval,
    stage timings, and when the job was created and the engine emitted its first token."""
    res = ((view.get("result") or {}).get("results") or [None])[0]
    if not res:
        return
    s.batch_size = res.get("batch_size")
    s.engine_time_s = res.get("engine_time_s")
    if s.engine_time_s is not None:
        s.engine_interval = engine_interval(view["created_at"], res.get("timings") or {}, s.engine_time_s)
    s.extra["timings"] = res.get("timings")
    s.extra["created_at"] = view.get("created_at")
    s.extra["first_token_at"] = res.get("first_token_at")


async def enrich(base_url: str, samples: list[Sample], concurrency: int = 8) -> int:
    """After a load point on the OpenAI endpoint of a server that also has the job API (the
    pipeline, the serial server): read each request's job for its server-side figures.
    Runs after the measurement, so it adds no load to it. Returns how many it got."""
    todo = [s for s in samples if s.ok and s.extra.get("job_id")]
    sem = asyncio.Semaphore(concurrency)
    got = 0

    async def one(http: httpx.AsyncClient, s: Sample) -> None:
        nonlocal got
        async with sem:
            try:
                r = await http.get(f"{base_url.rstrip('/')}/v1/jobs/{s.extra['job_id']}")
            except httpx.HTTPError:
                return
        if r.status_code == 200:
            apply_view(s, r.json())
            got += s.engine_time_s is not None

    async with http_client(concurrency) as http:
        await asyncio.gather(*(one(http, s) for s in todo))
    return got


class Client(Protocol):
    """What ``run_load`` drives: ``JobsClient`` here, ``OpenAIClient`` (openai_client.py)."""

    protocol: str

    async def request(self, http: httpx.AsyncClient, s: Sample, prompt: str) -> None: ...



async def _one(client: Client, http: httpx.AsyncClient, i: int, prompt: str, timeout_s: float | None) -> Sample:
    s = Sample(i=i, start=time.time())
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(client.request(http, s, prompt), timeout_s)
    except TimeoutError:
        s.ok, s.error = False, f"no complete answer within {timeout_s:g}s"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        s.ok, s.error = False, f"{type(e).__name__}: {e}"[:300]
    s.latency_s = time.perf_counter() - t0
    return s


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Built once: httpx builds one per client otherwise, loading the CA bundle each time
    # (~27 ms of CPU a client here), and the load generator makes a client per user.
    return httpx.create_ssl_context()


def http_client(max_connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=30.0, read=900.0, write=30.0, pool=900.0),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        verify=_ssl_context(),
    )


class ClientPool:
    """One-connection httpx clients, lent one per request in flight and kept for the next.

    httpx's connection pool does work in proportion to the connections it holds on every
    request and response: one pool shared by 64 closed-loop users cost the load generator
    19-21 ms of CPU per request on 2 cores (3-3.5 ms with a client each), and at c=64 it was
    the load generator, not the servers, that set the measured capacity."""

    def __init__(self) -> None:
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []

    @contextlib.contextmanager
    def lent(self) -> Iterator[httpx.AsyncClient]:
        http = self._idle.pop() if self._idle else self._new()
        try:
            yield http
        finally:
            self._idle.append(http)

    def _new(self) -> httpx.AsyncClient:
        http = http_client(1)
        self._all.append(http)
        return http

    async def __aenter__(self) -> ClientPool:
        return self

    async def __aexit__(self, *exc) -> None:
        for http in self._all:
            await http.aclose()


async def run_load(
    client: Client,
    prompts: list[str],
    *,
    requests: int,
    concurrency: int | None = None,
    rate: float | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    timeout_s: float | None = 300.0,
    on_done: Callable[[Sample], None] | None = None,
) -> list[Sample]:
    """Send ``requests`` requests (or as many as ``duration_s`` allows, whichever ends first),
    closed loop with
    ``concurrency`` clients or open loop at ``rate`` requests/s; samples in issue order.
    A request without a complete answer after ``timeout_s`` counts as an error."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency or rate")
    deadline = time.monotonic() + duration_s if duration_s else None
    limit = requests or 10**9
    samples: list[Sample] = []

    def more(i: int) -> bool:
        return i < limit and (deadline is None or time.monotonic() < deadline)

    async def one(i: int) -> None:
        with clients.lent() as http:
            s = await _one(client, http, i, prompts[i % len(prompts)], timeout_s)
        samples.append(s)
        if on_done is not None:
            on_done(s)

    _ssl_context()  # built before the clock starts: ~0.1 s on a busy machine, which late-started the schedule
    async with ClientPool() as clients:
        with clients.lent():  # likewise the first client (~20 ms: it imports httpx's transport)
            pass
        if concurrency is not None:
            counter = itertools.count()

            async def worker() -> None:
                while more(i := next(counter)):
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = random.Random(seed)
            gaps = [rng.expovariate(rate) for _ in range(min(limit, 100_000))]
            scale = (1.0 / rate) / (sum(gaps) / len(gaps))  # Poisson shape, the nominal mean rate
            tasks = []
            t_next = time.monotonic()
            for i in itertools.count():
                if not more(i):
                    break
                tasks.append(asyncio.create_task(one(i)))
                t_next += gaps[i % len(gaps)] * scale
                await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            await asyncio.gather(*tasks)
    return sorted(samples, key=lambda s: s.i)
