"""TEST-ONLY fault injection around a real engine. Never set LLMPIPE_FAULT_INJECT in production.

The reliability tests (tests/reliability/) start real workers with this variable set, as
JSON, to make the engine fail in chosen ways on prompts that contain a marker text, and
with the worker hook (workers/hook.py) naming ``install`` below (``env`` gives both)::

    LLMPIPE_WORKER_HOOK=llmpipe.testing.faulty:install
    LLMPIPE_FAULT_INJECT='{"poison": "POISON", "transient": {"FLAKY": 2}, "ledger": true}'

Keys (all optional):

- ``poison``: a batch holding a prompt with this text raises a permanent EngineError;
- ``fail_after_tokens``: {marker: n}: a batch holding a prompt with the marker runs in the
  engine for n tokens per request (they are streamed) and then raises a permanent
  EngineError, like an engine that fails mid-generation;
- ``transient``: {marker: n}: a request with the marker raises a transient EngineError
  ("out of memory") on its first n engine attempts in this process;
- ``crash``: a batch holding this text raises RuntimeError (an unexpected exception);
- ``die``: a batch holding this text raises EngineDeadError; with ``die_once`` (default)
  only the first time across all workers (a Redis SET NX), so a restarted worker recovers;
- ``die_always``: a batch holding this text raises EngineDeadError every time (a request
  that kills every worker it reaches);
- ``batch_delay_s``: every batch sleeps this long first (so a test can kill mid-batch);
- ``task_delay_s``: {task name: s}: a worker sleeps this long at the start of that task
  (Celery ``task_prerun``), so a test can kill a pre/postprocess worker mid-task;
- ``hold_at_tokens``: n: once per request, right after its n-th token is handed on (to be
  published), the engine's thread holds for the runtime delay ``tokens`` below (none when it
  is unset), so a test can kill a worker whose requests are surely mid-output;
- both delays can also be set while the workers run, and the token hold only so, in the
  Redis hash ``llmpipe:test:delays`` (field ``batch``, ``tokens`` or a task name, value in
  seconds); such a delay is a hold: it ends early when the field is deleted (a test clears
  it at a kill);
- the field ``load`` of that hash holds an engine's load at its end (where the engine is
  wrapped), for a test that stops a worker while its engine loads; the hold goes on
  through any exception raised into it, as a real load may (a finalizer, a library's
  bare ``except``), so the worker must stop without the load's help;
- ``ledger``: count, per request id, engine attempts and completions in the Redis hashes
  ``llmpipe:test:engine-started`` and ``llmpipe:test:engine-done``.

The engine sees token ids only; markers are matched on the decoded prompt.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmpipe.broker.redis_clients import from_settings
from llmpipe.engines.base import Engine, EngineOutput, EngineRequest, TokenCallback
from llmpipe.errors import EngineDeadError, EngineError
from llmpipe.settings import get_settings

log = logging.getLogger("llmpipe.faulty")

ENV = "LLMPIPE_FAULT_INJECT"
STARTED_KEY = "llmpipe:test:engine-started"
DONE_KEY = "llmpipe:test:engine-done"
DIED_KEY = "llmpipe:test:engine-died"
DELAYS_KEY = "llmpipe:test:delays"


def _runtime_delay(r: Any, name: str) -> float:
    """The delay set for ``name`` in DELAYS_KEY (0 when none). A failed read is tried again:
    a test that set a delay counts on it holding the work."""
    if r is None:
        return 0.0
    for attempt in range(3):
        try:
            v = r.hget(DELAYS_KEY, name)
            return float(v) if v else 0.0
        except Exception as exc:
            log.warning("fault delay %s not read (attempt %d: %s)", name, attempt + 1, exc)
            time.sleep(0.1)
    return 0.0


def _deaf_hold(r: Any, name: str, seconds: float) -> None:
    """``_hold``, carried on through whatever a signal handler raises into it."""
    if seconds > 0:
        log.warning("holding the %s (test)", name)
    end = time.monotonic() + seconds  # an exception does not restart the hold
    while True:
        try:
            return _hold(r, name, max(0.0, end - time.monotonic()))
        except BaseException:  # noqa: BLE001 - what a real load may do with a WorkerShutdown
            log.warning("the %s hold swallowed an exception and goes on", name)


def _hold(r: Any, name: str, seconds: float, *, every: float = 0.05,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Sleep up to ``seconds``, less when the test clears the delay meanwhile. A test sets
    a long hold so that a slow step of its own (rabbitmqctl takes seconds on a busy host)
    cannot outlast it, and clears it at the kill so that the survivors go on at once."""
    end = clock() + seconds
    while (left := end - clock()) > 0:
        sleep(min(every, left))
        if r is None:
            continue
        try:
            if not r.hexists(DELAYS_KEY, name):
                return
        except Exception:  # cannot tell: hold on, to the end at most
            pass


@dataclass(frozen=True)
class FaultSpec:
    poison: str | None = None
    fail_after_tokens: dict[str, int] = field(default_factory=dict)
    transient: dict[str, int] = field(default_factory=dict)
    crash: str | None = None
    die: str | None = None
    die_once: bool = True
    die_always: str | None = None
    batch_delay_s: float = 0.0
    task_delay_s: dict[str, float] = field(default_factory=dict)
    hold_at_tokens: int = 0
    ledger: bool = False

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{ENV} must be a JSON object")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{ENV}: unknown keys {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_env(cls) -> FaultSpec | None:
        text = os.environ.get(ENV, "").strip()
        return cls.parse(text) if text else None


class FaultInjectingEngine(Engine):
    def __init__(self, inner: Engine, spec: FaultSpec, decode: Callable[[list[int]], str], redis_client: Any = None):
        self.inner = inner
        self.spec = spec
        self._decode = decode
        self._r = redis_client
        self._attempts: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self.name = f"faulty-{inner.name}"
        self.continuous = inner.continuous
        self.supports_logprobs = inner.supports_logprobs
        self.supports_structured_outputs = inner.supports_structured_outputs
        self.unsupported_params = inner.unsupported_params
        log.warning("FAULT INJECTION is on (%s=%s): this engine fails on purpose", ENV, spec)

    @property
    def max_model_len(self) -> int | None:
        return self.inner.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return list(getattr(self.inner, "eos_token_ids", ()) or ())

    def _ledger(self, key: str, batch: list[EngineRequest]) -> None:
        if not (self.spec.ledger and self._r is not None):
            return
        try:
            pipe = self._r.pipeline(transaction=False)
            for r in batch:
                pipe.hincrby(key, r.request_id, 1)
            pipe.execute()
        except Exception as exc:  # a test hook: a Redis outage must not change what the engine does
            log.warning("fault ledger %s not counted for %d requests (%s)", key, len(batch), exc)

    def generate(self, batch: list[EngineRequest], on_tokens: TokenCallback | None = None) -> list[EngineOutput]:
        texts = [self._decode(r.prompt_token_ids) for r in batch]
        with self._lock:
            for r in batch:
                self._attempts[r.request_id] += 1
            attempts = [self._attempts[r.request_id] for r in batch]
        self._ledger(STARTED_KEY, batch)
        s = self.spec

        def has(marker: str | None) -> bool:
            return bool(marker) and any(marker in t for t in texts)

        if has(s.die_always):
            raise EngineDeadError(f"injected engine death, every time (a prompt holds {s.die_always!r})")
        if has(s.die) and (not s.die_once or self._r is None or self._r.set(DIED_KEY, 1, nx=True, ex=3600)):
            raise EngineDeadError(f"injected engine death (a prompt holds {s.die!r})")
        if s.batch_delay_s > 0:
            time.sleep(s.batch_delay_s)
        else:
            _hold(self._r, "batch", _runtime_delay(self._r, "batch"))
        if has(s.crash):
            raise RuntimeError(f"injected unexpected exception (a prompt holds {s.crash!r})")
        if has(s.poison):
            raise EngineError(f"injected engine failure (a prompt holds {s.poison!r})")
        if s.hold_at_tokens > 0 and on_tokens is not None:
            on_tokens = self._holding_at(s.hold_at_tokens, on_tokens)
        for marker, n in s.fail_after_tokens.items():
            if has(marker):
                short = [EngineRequest(r.request_id, r.prompt_token_ids,
                                       r.params.model_copy(update={"max_tokens": min(n, r.params.max_tokens)}))
                         for r in batch]
                self.inner.generate(short, on_tokens)
                raise EngineError(f"injected engine failure after {n} tokens (a prompt holds {marker!r})")
        for marker, times in s.transient.items():
            for t, n in zip(texts, attempts, strict=True):
                if marker in t and n <= times:
                    raise EngineError(f"CUDA out of memory (injected, attempt {n} of {times} failing)", transient=True)
        outs = self.inner.generate(batch, on_tokens)
        self._ledger(DONE_KEY, batch)
        return outs

    def _holding_at(self, n: int, on_tokens: TokenCallback) -> TokenCallback:
        """``on_tokens``, then the runtime hold ``tokens`` once per request at its ``n``-th
        token. The engine calls back from its own thread, which the hold stops: every request
        of this engine stays mid-output, its tokens so far handed on, until the test clears it."""
        held: set[str] = set()

        def call(request_id: str, ids: list[int]) -> None:
            on_tokens(request_id, ids)
            if len(ids) >= n and request_id not in held:
                held.add(request_id)
                _hold(self._r, "tokens", _runtime_delay(self._r, "tokens"))

        return call

    def abort(self, request_ids: list[str]) -> None:
        self.inner.abort(request_ids)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def shutdown(self) -> None:
        self.inner.shutdown()


def wrap_from_env(engine: Engine, settings: Any, model_path: str | None) -> Engine:
    """``engine`` wrapped per LLMPIPE_FAULT_INJECT, or ``engine`` itself when it is unset."""
    spec = FaultSpec.from_env()
    if spec is None:
        return engine

    tok = None
    lock = threading.Lock()

    def decode(ids: list[int]) -> str:
        nonlocal tok
        if model_path is None:
            return ""
        with lock:
            if tok is None:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(model_path)
        return tok.decode(ids)

    r = from_settings(settings, socket_timeout=5, socket_connect_timeout=3)
    _deaf_hold(r, "load", _runtime_delay(r, "load"))
    return FaultInjectingEngine(engine, spec, decode, r)


HOOK = "llmpipe.testing.faulty:install"


def env(faults: dict[str, Any]) -> dict[str, str]:
    """The variables that turn fault injection on in the workers a test starts."""
    return {"LLMPIPE_WORKER_HOOK": HOOK, ENV: json.dumps(faults)}


def install() -> Callable[[Engine, Any, str | None], Engine] | None:
    """The worker hook (workers/hook.py): the task delays now, and the engine wrapper."""
    if FaultSpec.from_env() is None:
        return None
    install_task_hooks()
    return wrap_from_env


def install_task_hooks() -> None:
    """Connect the ``task_delay_s`` sleeps (by ``install``)."""
    spec = FaultSpec.from_env()
    if spec is None:
        return
    from celery.signals import task_prerun

    delays = dict(spec.task_delay_s)
    clients: dict[int, Any] = {}  # one client per process (prefork children fork after this)

    @task_prerun.connect(weak=False)
    def _delay(sender=None, task=None, **_):
        name = getattr(task, "name", None) or getattr(sender, "name", "")
        r = clients.get(os.getpid())
        if r is None:
            r = clients[os.getpid()] = from_settings(get_settings(), socket_timeout=2)
        if delays.get(name):
            time.sleep(delays[name])
        else:
            _hold(r, name, _runtime_delay(r, name))

    log.warning("FAULT INJECTION is on: task delays %s", delays)
