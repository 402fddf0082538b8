"""Celery's task events (what Flower shows), published off the caller's thread.

Celery's ``EventDispatcher`` publishes on the calling thread and waits for the broker's
reply. A worker's main process flushes the task events it buffered at the start of its
event loop's next tick, before it writes the message it just took to a pool process, so
every hop of a request waited for one event round trip; the API and the stages' tasks
waited for each ``task-sent`` event likewise. Here the app's dispatchers (``Events``, given
to the Celery app) hand each event to one sender thread per process, which publishes them
in order on a connection of its own; the caller goes on at once.

Events stay what they are in Celery: best effort, in order, with the same fields and clock.
An event the sender cannot publish, even once more on a new connection, goes back to its
dispatcher's outbound buffer when the dispatcher buffers while offline (Celery's
``buffer_while_offline``: its next flush sends it again), else it is dropped with a log
line. ``close`` returns once the sender has published (or given up on) every event handed
over before it, so a worker's ``worker-offline`` still goes out as it stops.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any

from celery.app.events import Events as CeleryEvents
from celery.events.dispatcher import EventDispatcher
from kombu import Producer

log = logging.getLogger("llmpipe.observability.task_events")

CLOSE_WAIT_S = 5.0  # how long close() waits for the events handed over before it
# The sender's connection does not retry a broker that is down: its events go back at once,
# and a dispatcher that a lost connection closes (its worker reconnecting) is not held up.
FAIL_FAST = {"max_retries": 0}
MAX_PENDING = 10_000  # events waiting for the sender; beyond it new ones are dropped


class EventSender:
    """One thread that publishes the process's events in the order handed over, on a
    connection of its own (``connect()``: a new kombu connection to the broker)."""

    def __init__(self, connect, max_pending: int = MAX_PENDING):
        self._connect = connect
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._dropping = False  # warned of a full queue; again only after it took one
        self._conn = self._producer = None  # the sender thread's own
        self._thread = threading.Thread(target=self._run, name="llmpipe-task-events", daemon=True)
        self._thread.start()

    def put(self, dispatcher: EventDispatcher, event: Any, routing_key: str) -> None:
        try:
            self._queue.put_nowait((dispatcher, event, routing_key))
            self._dropping = False
        except queue.Full:
            if not self._dropping:  # once per spell: the broker is down, not each event
                log.warning("task events: %d wait for the broker; dropping new ones", self._queue.maxsize)
            self._dropping = True

    def drain(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """Waits until every event handed over before this call is published (or given up)."""
        done = threading.Event()
        try:
            self._queue.put((None, done, ""), timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            dispatcher, event, routing_key = self._queue.get()
            if dispatcher is None:  # a drain's mark: everything before it is out
                event.set()
                continue
            self._publish(dispatcher, event, routing_key)

    def _publish(self, dispatcher: EventDispatcher, event: Any, routing_key: str) -> None:
        """Sends one event; on an error, once more on a new connection (the broker may have
        restarted, or closed a connection that stayed quiet), then gives it back."""
        for attempt in (1, 2):
            try:
                if self._producer is None:
                    self._conn = self._connect()
                    self._producer = Producer(self._conn, auto_declare=False)
                _send(self._producer, dispatcher, event, routing_key)
                return
            except Exception as exc:
                self._reset()
                if attempt == 2:
                    _gave_up(dispatcher, event, routing_key, exc)

    def _reset(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # a broken connection may fail to close: it is dropped anyway
                log.debug("task events: closing a broken connection failed", exc_info=True)
        self._conn = self._producer = None


def _send(producer: Producer, d: EventDispatcher, event: Any, routing_key: str) -> None:
    """What Celery's ``EventDispatcher._publish`` sends, as it sends it."""
    producer.publish(event, routing_key=routing_key, exchange=d.exchange.name, declare=[d.exchange],
                     serializer=d.serializer, headers=d.headers, delivery_mode=d.delivery_mode)


def _gave_up(d: EventDispatcher, event: Any, routing_key: str, exc: Exception) -> None:
    if d.buffer_while_offline:
        with d.mutex:
            d._outbound_buffer.append((event, routing_key))  # Celery's own retry: its next flush
        return
    log.warning("task events: %s not published: %s: %s", routing_key, type(exc).__name__, exc)


_senders: dict[tuple[int, int], EventSender] = {}  # (pid, app id) -> its sender
_senders_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child has no sender threads, and maybe a lock a parent's thread held."""
    global _senders_lock
    _senders.clear()
    _senders_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def started_sender(app) -> EventSender | None:
    """The process's sender for ``app`` if one was started, else None."""
    with _senders_lock:
        return _senders.get((os.getpid(), id(app)))


def sender_for(app) -> EventSender:
    """The process's sender for ``app``, started on first use (in a forked child too)."""
    key = (os.getpid(), id(app))
    with _senders_lock:
        if key not in _senders:
            _senders[key] = EventSender(lambda: app.connection_for_write(transport_options=FAIL_FAST))
        return _senders[key]


class BackgroundDispatcher(EventDispatcher):
    """Celery's dispatcher (buffering, groups, clock and fields unchanged) whose publishing
    is the process's sender thread's."""

    def _publish(self, event, producer, routing_key, retry=False, retry_policy=None, **_):
        if producer is None:  # closed or disabled, as in Celery's
            return
        sender_for(self.app).put(self, event, routing_key)

    def close(self):
        sender = started_sender(self.app)  # none: this process never sent, so nothing waits
        if self.enabled and sender is not None and not sender.drain():
            log.warning("task events: the broker did not take the pending events within %.0f s", CLOSE_WAIT_S)
        super().close()


class Events(CeleryEvents):
    """``app.events`` with the background dispatcher."""

    dispatcher_cls = "llmpipe.observability.task_events:BackgroundDispatcher"
