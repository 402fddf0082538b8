"""Partial output from the GPU worker to the API, through one Redis stream per job.

The engine calls ``on_tokens`` from its own thread for every step; that must stay cheap,
so the publisher only records the newest ids and a background thread writes the deltas
in one pipelined round trip per flush. That thread writes every entry of a request, its
last one too (``finish`` waits for it), and flushes never overlap: a request's entries
reach Redis in order, and all of them before ``finish`` returns. Streaming requests flush
every ``flush_s``; the others every ``partial_every_s``, which is enough for
``GET /v1/jobs/{id}`` to show the text produced so far.

Entry fields: ``i`` prompt index, ``o`` offset of the first id in ``d``, ``d`` the new
token ids as JSON. A streaming job's last entry is its end marker, ``e`` (the job's terminal
status), written by the job record's terminal move (llmpipe/jobs/store.py): the SSE reader blocks
on the stream and wakes at it, without polling. Streaming requests' entries also carry ``p``, the prompt's length in
tokens (the usage on every chunk), and ``t``, the prompt's last ids as JSON (the API decodes
after them, as postprocess does). Offsets make a replayed entry idempotent to readers.

What is published is never taken back: a request that is run again (a batch split after an
engine error, a message redelivered after a crash) resumes from the ids already published
for it (``register(prefix=...)``, :func:`read_published`), so the stream always stays a
prefix of the final output (llmpipe/processors/inference_processor.py). A request that
cannot resume exactly (it asked for log probabilities or a grammar) is not published
unless it streams (llmpipe/processors/inference_processor.py says why).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("llmpipe.jobs.streaming")


STREAM_TTL_S = 900  # a job's token stream outlives its last write by this long
# ``finish`` waits this long at most for the publisher's thread to write the request's last
# entry (a Redis client's own timeouts end a write sooner), then writes it itself.
FINISH_WAIT_S = 10.0


def stream_key(job_id: str) -> str:
    return f"llmpipe:tokens:{job_id}"


def is_end(fields: dict) -> bool:
    """The entry that the job's terminal move appends to a streaming job's stream (llmpipe/jobs/store.py)."""
    return b"e" in fields or "e" in fields


@dataclass
class _Tracked:
    job_id: str
    index: int
    stream: bool
    prompt_tokens: int | None = None
    prompt_tail: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    published: int = 0
    last_flush: float = 0.0
    done: bool = False
    parse: Any = None  # a ParsedStream (llmpipe/parsing/streams.py) when the output is parsed here
    stop_terminated: bool = False  # (at the end) the last id stopped the output
    written: threading.Event = field(default_factory=threading.Event)  # (once done) its last entry is in Redis


class TokenPublisher:
    def __init__(self, redis_client: Any, *, flush_s: float = 0.02, partial_every_s: float = 0.5,
                 ttl_s: int = STREAM_TTL_S, maxlen: int = 100_000, clock=time.monotonic):
        self.r = redis_client
        self.flush_s = flush_s
        self.partial_every_s = partial_every_s
        self.ttl_s = ttl_s
        self.maxlen = maxlen
        self._clock = clock
        self._lock = threading.Lock()  # the tracked requests
        self._writing = threading.Lock()  # one flush at a time: entries reach Redis in the order taken
        self._tracked: dict[str, _Tracked] = {}
        self._stop = threading.Event()
        self._work = threading.Event()  # set by register: the loop sleeps while nothing is tracked
        self._thread = threading.Thread(target=self._loop, name="llmpipe-token-publisher", daemon=True)
        self._thread.start()

    def register(self, request_id: str, job_id: str, index: int, stream: bool, prefix: list[int] | None = None, *,
                 prompt_tokens: int | None = None, prompt_tail: list[int] | None = None, parse: Any = None) -> None:
        """``prefix``: ids already published for this request (by an earlier delivery).
        ``prompt_tokens``, ``prompt_tail``: what a streaming request's entries carry.
        ``parse``: a ParsedStream that already took ``prefix`` in, for a parsed output."""
        prefix = list(prefix or [])
        with self._lock:
            self._tracked[request_id] = _Tracked(job_id, index, stream, prompt_tokens, prompt_tail, ids=prefix,
                                                 published=len(prefix), last_flush=self._clock(), parse=parse)
        self._work.set()

    def on_tokens(self, request_id: str, ids_so_far: list[int]) -> None:
        t = self._tracked.get(request_id)
        if t is not None:
            t.ids = ids_so_far  # a reference swap: safe without the lock
            if t.stream and not t.published:
                self._work.set()  # a stream's first tokens go out at once (time to first token)

    def finish(self, request_id: str, final_ids: list[int] | None = None, *, stop_terminated: bool = False) -> None:
        """``stop_terminated``: the output ended at a stop token or EOS (its last id), whose
        text a parsed output leaves out. Returns once the request's last entry is in Redis:
        the job's end marker, written after this returns (llmpipe/jobs/store.py), must follow
        it, or a reader that stops at the marker misses the end of the output."""
        with self._lock:
            t = self._tracked.get(request_id)
            if t is None:
                return
            if not t.stream:
                # Nobody reads a request that does not stream from its end: its result
                # follows at once, and a redelivery replays the stored result. What it
                # published while it ran stays a prefix of the final output.
                del self._tracked[request_id]
                return
            if final_ids is not None:
                t.ids = final_ids
            t.done = True
            t.stop_terminated = stop_terminated
        # The thread writes it: had this thread written it, a flush the thread had under
        # way could land an earlier entry after it (and after the end marker).
        self._work.set()
        if not (self._thread.is_alive() and t.written.wait(FINISH_WAIT_S)):
            log.warning("the publisher's thread did not write request %s's last entry; writing it here", request_id)
            self.flush(force=True)

    def flush(self, force: bool = False) -> int:
        with self._writing:
            entries, ended = self._take(force)
            try:
                if entries:
                    self._write(entries)
            finally:
                for t in ended:
                    t.written.set()
        return len(entries)

    def _take(self, force: bool) -> tuple[list[tuple[str, dict]], list[_Tracked]]:
        """The entries due now, and the requests that end with them (no longer tracked)."""
        now = self._clock()
        entries, ended = [], []
        with self._lock:
            for rid, t in list(self._tracked.items()):
                due = (force or t.done or (t.stream and not t.published)
                       or now - t.last_flush >= (self.flush_s if t.stream else self.partial_every_s))
                if due and len(t.ids) > t.published:
                    fields = self._entry(t)
                    if fields is not None:
                        entries.append((t.job_id, fields))
                        t.last_flush = now
                if t.done:
                    del self._tracked[rid]
                    ended.append(t)
        return entries, ended

    def _write(self, entries: list[tuple[str, dict]]) -> None:
        try:
            pipe = self.r.pipeline(transaction=False)
            for job_id, fields in entries:
                key = stream_key(job_id)
                pipe.xadd(key, fields, maxlen=self.maxlen, approximate=True)
                pipe.expire(key, self.ttl_s)
            pipe.execute()
        except Exception:  # partial output is best effort; the result still comes via the chord
            log.warning("could not publish partial output", exc_info=True)

    def _entry(self, t: _Tracked) -> dict | None:
        """The next entry of ``t`` (None: nothing new to publish yet); moves ``t.published``."""
        upto, deltas = len(t.ids), None
        if t.parse is not None:
            try:
                upto, deltas = t.parse.advance(t.ids, final=t.done, stop_terminated=t.stop_terminated)
            except Exception:  # a parser bug must not stop the stream: postprocess's result completes it
                log.warning("could not parse a streamed output; it is published unparsed", exc_info=True)
                t.parse, upto, deltas = None, len(t.ids), None
        if upto <= t.published:
            return None
        fields = {"i": t.index, "o": t.published, "d": json.dumps(t.ids[t.published:upto])}
        if deltas is not None:
            fields["m"] = json.dumps(deltas, separators=(",", ":"))
            if t.done:
                fields["f"] = 1  # the parser saw the end: these deltas are all the output has
        if t.stream and t.prompt_tokens is not None:
            fields["p"] = t.prompt_tokens
        if t.stream and t.prompt_tail is not None:
            fields["t"] = json.dumps(t.prompt_tail)
        t.published = upto
        return fields

    def _loop(self) -> None:
        while not self._stop.is_set():
            # Every flush_s, or at once when a stream's first tokens came (on_tokens) or a
            # request ended (finish); idle, no wake-up every flush_s. What was asked before
            # the clear, the flush after it sees: no wake-up is lost.
            self._work.wait(self.flush_s if self._tracked else 1.0)
            self._work.clear()
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._work.set()
        self._thread.join(timeout=2)
        self.flush(force=True)


@dataclass
class PromptInfo:
    """What a streaming request's entries say about its prompt."""

    tokens: int = 0
    tail: list[int] = field(default_factory=list)


def apply_entries(entries: list[tuple[Any, dict]], ids_by_index: dict[int, list[int]],
                  prompts: dict[int, PromptInfo] | None = None,
                  deltas: dict[int, list[dict]] | None = None, ended: set[int] | None = None) -> dict[int, list[int]]:
    """Merge stream entries into ``ids_by_index``; returns the ids new to each index.
    ``prompts`` (optional) collects each index's prompt length and tail, when entries carry them;
    ``deltas`` (optional) the delta messages of a parsed output, in order, and ``ended`` the
    indexes whose parser saw the end.

    Entries carry their offset, so a replayed entry adds nothing."""
    new: dict[int, list[int]] = {}
    for _, fields in entries:
        f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in fields.items()}
        if "i" not in f:
            continue  # the job's end marker
        i, off, delta = int(f["i"]), int(f["o"]), json.loads(f["d"])
        if prompts is not None and i not in prompts and "p" in f:
            prompts[i] = PromptInfo(int(f["p"]), json.loads(f["t"]) if "t" in f else [])
        have = ids_by_index.setdefault(i, [])
        if off > len(have):
            continue  # a gap: wait for the entry that fills it
        fresh = delta[len(have) - off:]
        if fresh and deltas is not None and "m" in f and off == len(have):
            deltas.setdefault(i, []).extend(json.loads(f["m"]))
            if ended is not None and "f" in f:
                ended.add(i)
        if fresh:
            have.extend(fresh)
            new.setdefault(i, []).extend(fresh)
    return new


def read_published(r: Any, job_id: str) -> dict[int, list[int]]:
    """Every id published so far for the job, by prompt index (one XRANGE)."""
    ids: dict[int, list[int]] = {}
    apply_entries(r.xrange(stream_key(job_id)), ids)
    return ids
