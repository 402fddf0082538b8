"""Stacks with several inference workers of one model, and what the failover and routing
tests read of them: each worker's own queue, its routing load, a streamed completion.
Built on tests/harness/pipe.py (``start_pipe``, ``Pipe``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx

from llmpipe.jobs.lanes import queue_keys
from llmpipe.routing.keys import LOAD_KEY, MEMBERS_KEY
from llmpipe.stages import Stage, worker_queue
from tests.harness.pipe import Pipe, start_pipe

SHARED = Stage.INFERENCE.value


def start_workers_pipe(tmp_path: Path, *, model: str, workers: int = 2, engine: str = "vllm",
                       broker_url: str | None = None, faults: dict | None = None, **overrides) -> Pipe:
    """``start_pipe`` with ``workers`` inference workers of ``model``, the engine ledger and
    ``faults`` (llmpipe/testing/faulty.py).
    Prefixes are hashed by blocks of 4 tokens, so that the tests' short prompts are routed
    (vLLM's own block on the CPU is 128 tokens)."""
    return start_pipe(tmp_path, engine=engine, model=model, broker_url=broker_url,
                      faults={"ledger": True, **(faults or {})}, inference_workers=workers,
                      **{"route_block_size": 4, **overrides})


def inference_children(pipe: Pipe) -> list[str]:
    return [c.name for c in pipe.lp.sup.children if c.name.startswith(SHARED)]


def own_queue(pipe: Pipe, child: str) -> str:
    return worker_queue(SHARED, pipe.node(child))


def own_depth(pipe: Pipe, child: str) -> int:
    """Messages waiting in the worker's own queue (not the ones it holds)."""
    q = own_queue(pipe, child)
    if pipe.amqp is None:
        return sum(int(pipe.r.llen(k)) for k in queue_keys(q))
    try:
        return pipe.queue_state(q)[0]
    except Exception:  # not declared (yet): nothing waits there
        return 0


def routing_load(pipe: Pipe, child: str) -> int:
    """What routing counts for the worker: what it holds plus what waits for it."""
    v = pipe.r.hget(LOAD_KEY, own_queue(pipe, child))
    return int(v) if v is not None else 0


def is_member(pipe: Pipe, child: str) -> bool:
    """Routing sees the worker live (its membership is renewed)."""
    score = pipe.r.zscore(MEMBERS_KEY, own_queue(pipe, child))
    return score is not None and score > float(pipe.r.time()[0])


class Stream:
    """A streamed completion read on a thread: its job id, and its text as it comes."""

    def __init__(self, api_url: str, body: dict, timeout: float = 180):
        self.job = ""
        self.opened = False  # the API took the request (the job exists)
        self.parts: list[str] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(api_url, body, timeout), daemon=True)
        self._thread.start()

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def _read(self, api_url: str, body: dict, timeout: float) -> None:
        try:
            with httpx.Client(base_url=api_url, timeout=timeout) as c, c.stream(
                    "POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200, r.read()
                self.opened = True
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    self.job = self.job or chunk["id"].removeprefix("cmpl-")
                    self.parts.extend(ch.get("text", "") for ch in chunk.get("choices", []))
        except BaseException as exc:  # the test reads it after join
            self.error = exc

    def join(self, timeout: float) -> str:
        """The whole streamed text; raises what the reader met."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"stream of job {self.job or '?'} not finished after {timeout}s")
        if self.error is not None:
            raise self.error
        return self.text
