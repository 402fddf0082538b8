"""TokenizedRequest -> Generation, through the batcher and the engine."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

from llmpipe.engines.base import Engine, EngineOutput, EngineRequest, refusal
from llmpipe.errors import BadRequestError, CancelledError, EngineDeadError, EngineError, ExpiredError
from llmpipe.messages import (
    Detokenizing,
    ErrorReason,
    FinishReason,
    Generation,
    SamplingParams,
    Stage,
    StageError,
    TokenizedRequest,
)
from llmpipe.processors.batching import Batcher
from llmpipe.processors.envelope import WallClock, run_stage
from llmpipe.processors.isolation import run_isolated

log = logging.getLogger("llmpipe.inference")

# How many of the prompt's last ids postprocess decodes the output after (as vLLM's
# detokenizer does): enough for a leading space or a character split across tokens.
PROMPT_TAIL = 8


def resumable(params: SamplingParams) -> bool:
    """Whether a request that runs again can continue exactly from the ids it emitted.
    Not when it asked for log probabilities: the emitted ids' logprobs (and the prompt's,
    which would then cover them too) are gone with the attempt that made them. Not with a
    grammar (guided decoding): vLLM would start the grammar again at the continuation. Not
    with presence or frequency penalties or bad words: the emitted ids would count as
    prompt, which those do not see. Such a request runs again whole; the API refuses to
    stream logprobs, so only a streamed one of the others can have shown ids, and it fails
    rather than take them back."""
    return (params.logprobs is None and params.prompt_logprobs is None and params.structured is None
            and not params.presence_penalty and not params.frequency_penalty and not params.bad_words)


@dataclass(frozen=True)
class _Done:
    output: EngineOutput
    batch_size: int
    engine_time_s: float


class InferenceProcessor:
    """Owns the batcher in front of one engine. One per inference worker process.

    ``publisher`` (a TokenPublisher) receives tokens as the engine makes them;
    ``cancelled_jobs`` answers which of some job ids were cancelled, checked right before
    a batch reaches the engine; ``cancel(job_id)`` aborts a job's requests in the engine;
    ``published(job_id)`` reads the ids already published for a job's requests.
    ``batch_lane(req)`` tells a batch-lane request; on a continuous engine at most
    ``batch_lane_slots`` of them run at once (the batcher holds the rest), for
    ``batch_lane_hold_s`` after the last interactive request (None: always), and at most
    ``batch_lane_starting`` of those are in their prefill at once.

    Request migration: tokens that were emitted are never taken back, because a streaming
    client may already show them. A request that runs again (its batch failed after it
    produced tokens and was split; its message was redelivered after a crash) resumes
    from the tokens it emitted: the engine gets prompt + those ids and the rest of
    ``max_tokens``, and the output is those ids + the continuation. So the streamed text
    is always a prefix of the final text, whatever temperature and however many attempts.
    A request that cannot resume exactly (:func:`resumable`: logprobs, a grammar) runs
    again whole instead, and is published only when it streams.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        window_s: float,
        max_size: int,
        company_expected: Callable[[], bool] | None = None,
        interactive_company: Callable[[], bool] | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        publisher=None,
        cancelled_jobs: Callable[[Iterable[str]], set[str]] | None = None,
        retry_attempts: int = 3,
        on_engine_dead: Callable[[BaseException], None] | None = None,
        published: Callable[[str], dict[int, list[int]]] | None = None,
        stream_parser: Callable[[TokenizedRequest, list[int]], object | None] | None = None,
        batch_lane: Callable[[TokenizedRequest], bool] | None = None,
        batch_lane_slots: int | None = None,
        batch_lane_hold_s: float | None = None,
        batch_lane_starting: int | None = None,
        clock: WallClock = time.time,
    ):
        self.engine = engine
        # Called on the batch thread when the engine is gone (EngineDeadError), before any
        # request hears of it: the worker requeues its messages and exits (workers/engine_death.py).
        self._on_engine_dead = on_engine_dead
        self._clock = clock
        self._publisher = publisher
        self._cancelled_jobs = cancelled_jobs
        self._attempts = retry_attempts
        self._published = published
        # (request, ids it already streamed) -> the ParsedStream of a streamed chat output that
        # the model's parsers parse here (llmpipe/parsing/streams.py), or None.
        self._stream_parser = stream_parser
        self._lock = threading.Lock()
        self._running: dict[str, set[str]] = defaultdict(set)  # job id -> request ids in the engine
        self._aborted: set[str] = set()  # request ids already aborted: the broadcast and the sweep both report a cancel
        # request id -> every id emitted for it so far, over all attempts (replaced, never mutated)
        self._emitted: dict[str, list[int]] = {}
        # A continuous engine takes new requests while a batch runs, so batches are not
        # serialized: arrivals join vLLM's running batch instead of waiting for it to end.
        # Up to max_size batches may be in flight (batches of one at low load), and vLLM's
        # own scheduler (max_num_seqs) bounds what actually runs.
        self.batcher: Batcher[TokenizedRequest] = Batcher(
            self._run_batch,
            window_s=window_s,
            max_size=max_size,
            concurrent_batches=max_size if engine.continuous else 1,
            company_expected=company_expected,
            # While the batch lane is held to its share, a request waits out the window only for
            # interactive company: batch-lane requests enter through the cap one at a time.
            uncapped_company=interactive_company,
            on_batch=on_batch,
            order=lambda r: r.priority,  # vLLM's priority: lower first (the interactive lane)
            # A continuous engine runs at most batch_lane_slots batch-lane requests, so an
            # interactive one finds a running slot free (vLLM never preempts for it) and shares
            # its steps with at most that many batch requests' prefills.
            **({"capped": batch_lane, "cap": batch_lane_slots, "cap_hold_s": batch_lane_hold_s,
                "starting_cap": batch_lane_starting, "key": lambda r: r.request_id}
               if engine.continuous and batch_lane is not None and batch_lane_slots is not None else {}),
        )

    def process(self, req: TokenizedRequest, resume: bool = False) -> Generation:
        """``resume``: the message was delivered before (a crash); continue from what the
        earlier delivery published instead of starting over."""
        return run_stage(Stage.INFERENCE, req, lambda r: self._generate(r, resume), self.failed, self._clock)

    def cancel(self, job_id: str) -> list[str]:
        """Abort the job's requests running in the engine; each one once."""
        with self._lock:
            ids = [i for i in self._running.get(job_id, ()) if i not in self._aborted]
            self._aborted.update(ids)
        if ids:
            log.info("job=%s stage=inference aborting %d running requests", job_id, len(ids))
            self.engine.abort(ids)
        return ids

    def running_jobs(self) -> list[str]:
        """Jobs with requests in the engine that no cancel has aborted yet."""
        with self._lock:
            return [j for j, ids in self._running.items() if not ids <= self._aborted]

    def _prefix(self, req: TokenizedRequest) -> list[int]:
        if self._published is None:
            return []
        try:
            ids = self._published(req.job_id).get(req.index, [])
        except Exception as exc:  # without it the request starts over, as before migration
            log.warning("job=%s index=%d stage=inference could not read its published tokens (%s)",
                        req.job_id, req.index, exc)
            return []
        if ids:
            log.info("job=%s index=%d stage=inference resumes after %d published tokens", req.job_id, req.index, len(ids))
        return ids

    def _generate(self, req: TokenizedRequest, resume: bool = False) -> Generation:
        self._check_supported(req)
        # A request that cannot resume exactly and does not stream is neither published nor
        # remembered: whatever happens to an attempt, it runs again whole, and nobody saw
        # the ids of the attempt that failed (see resumable()).
        tracked = req.stream or resumable(req.params)
        prefix = self._prefix(req) if resume and tracked else []
        if tracked:
            self._emitted[req.request_id] = prefix
        if self._publisher is not None and tracked:
            parse = self._stream_parser(req, prefix) if req.stream and req.parsing and self._stream_parser else None
            self._publisher.register(req.request_id, req.job_id, req.index, req.stream, prefix=prefix,
                                     prompt_tokens=len(req.prompt_token_ids),
                                     prompt_tail=req.prompt_token_ids[-PROMPT_TAIL:], parse=parse)
        done: _Done | None = None
        try:
            fut = self.batcher.submit(req)
            try:
                done = fut.result(timeout=max(0.0, req.deadline - self._clock()))
            except FutureTimeout:
                self.engine.abort([req.request_id])
                raise ExpiredError("job deadline passed during inference") from None
        finally:
            if self._publisher is not None:
                out = done.output if done is not None else None
                self._publisher.finish(req.request_id, None if out is None else out.token_ids,
                                       stop_terminated=out is not None and out.finish_reason == FinishReason.STOP)
            self._emitted.pop(req.request_id, None)
        return self._generation(req, done)

    def _generation(self, req: TokenizedRequest, done: _Done) -> Generation:
        out = done.output
        if out.finish_reason == FinishReason.CANCELLED:
            raise CancelledError("job cancelled while the engine ran it")
        parsing = None if req.parsing is None else req.parsing.model_copy(update={"prompt_token_ids": req.prompt_token_ids})
        return Generation(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_tokens=len(req.prompt_token_ids), output_token_ids=out.token_ids, priority=req.priority,
            model=req.model,
            finish_reason=out.finish_reason, batch_size=done.batch_size,
            engine_time_s=done.engine_time_s, first_token_at=out.first_token_at, stop=req.params.stop,
            stop_token=out.stop_token, prompt_tail=req.prompt_token_ids[-PROMPT_TAIL:],
            prompt_token_ids=req.prompt_token_ids if req.params.echo else None,
            logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs,
            detok=Detokenizing.of(req.params), parsing=parsing,
        )

    def _check_supported(self, req: TokenizedRequest) -> None:
        """A request asking for what this engine cannot do fails, naming the field; it is
        never served without it. (The API refuses it first, from the engine's class.)"""
        refused = refusal(self.engine, req.params)
        if refused is None:
            return
        field, message = refused
        if field == "structured":
            forced = req.parsing is not None and req.parsing.tool_choice not in (None, "none")
            field = "tool_choice" if forced else "response_format"
        raise BadRequestError(message, param=field)

    def _run_batch(self, batch: list[TokenizedRequest]) -> list[_Done | Exception]:
        now = self._clock()
        gone = self._cancelled([r.job_id for r in batch])
        results: list[_Done | Exception | None] = [None] * len(batch)
        live: list[tuple[int, TokenizedRequest]] = []
        for i, r in enumerate(batch):
            if r.job_id in gone:
                results[i] = CancelledError("job cancelled before the engine started it")
            elif now >= r.deadline:
                # Expired work never reaches the engine.
                results[i] = ExpiredError("job deadline passed before the engine started it")
            else:
                live.append((i, r))
        if live:
            with self._lock:
                for _, r in live:
                    self._running[r.job_id].add(r.request_id)
            t0 = time.monotonic()
            try:
                outs = run_isolated(
                    self._run_engine,
                    [EngineRequest(r.request_id, r.prompt_token_ids, r.params, r.priority, r.reasoning_ended)
                     for _, r in live],
                    attempts=self._attempts,
                )
            except EngineDeadError as exc:
                log.critical("the engine died running a batch of %d: %s", len(live), exc)
                if self._on_engine_dead is not None:
                    self._on_engine_dead(exc)
                raise
            finally:
                with self._lock:
                    for _, r in live:
                        ids = self._running.get(r.job_id)
                        self._aborted.discard(r.request_id)
                        if ids is not None:
                            ids.discard(r.request_id)
                            if not ids:
                                del self._running[r.job_id]
            dt = time.monotonic() - t0
            for (i, _), out in zip(live, outs, strict=True):
                results[i] = out if isinstance(out, Exception) else _Done(out, len(live), dt)
        return results  # type: ignore[return-value]

    def _cancelled(self, job_ids: list[str]) -> set[str]:
        """Which jobs were cancelled; none when Redis cannot say. The batch must not fail for
        it (its tasks would then fail on Redis too, after their body): a cancelled job still
        has its running requests aborted by the broadcast, and its record stays cancelled."""
        if self._cancelled_jobs is None:
            return set()
        try:
            return self._cancelled_jobs(job_ids)
        except Exception as exc:
            log.warning("stage=inference could not read cancellations for %d jobs (%s: %s); running them",
                        len(job_ids), type(exc).__name__, exc)
            return set()

    def _run_engine(self, reqs: list[EngineRequest]) -> list[EngineOutput | EngineError]:
        """One engine attempt; each request resumes from the ids it emitted before."""
        bases = [self._emitted.get(r.request_id, []) for r in reqs]
        outs: list[EngineOutput | EngineError | None] = [None] * len(reqs)
        todo: list[tuple[int, EngineRequest]] = []
        for i, (r, base) in enumerate(zip(reqs, bases, strict=True)):
            if base and not resumable(r.params):  # a streamed grammar request whose stream began
                outs[i] = EngineError(f"the engine failed after {len(base)} tokens were streamed, and a structured "
                                      "output cannot resume from them; send the request again")
                continue
            if base:
                finished = self._finished_by(r, base)
                if finished is not None:
                    stop_token = base[-1] if finished is FinishReason.STOP and base[-1] in r.params.stop_token_ids else None
                    outs[i] = EngineOutput(r.request_id, list(base), finished, stop_token=stop_token)
                    continue
                left = {"max_tokens": r.params.max_tokens - len(base), "min_tokens": max(0, r.params.min_tokens - len(base))}
                r = EngineRequest(r.request_id, [*r.prompt_token_ids, *base], r.params.model_copy(update=left),
                                  r.priority, r.reasoning_ended)
            todo.append((i, r))
        if todo:
            base_of = {r.request_id: bases[i] for i, r in todo}
            publisher = self._publisher

            begun: set[str] = set()

            def on_tokens(rid: str, ids: list[int]) -> None:
                if rid not in begun:  # its prefill is done: the batcher may start the next one
                    begun.add(rid)
                    self.batcher.started(rid)
                base = base_of.get(rid)
                full = [*base, *ids] if base else ids
                # Not when its task already gave up on it (deadline), nor when it reruns whole.
                if rid not in self._emitted:
                    return
                self._emitted[rid] = full
                if publisher is not None:
                    publisher.on_tokens(rid, full)

            got = self.engine.generate([r for _, r in todo], on_tokens)
            for (i, _), out in zip(todo, got, strict=True):
                outs[i] = replace(out, token_ids=[*bases[i], *out.token_ids]) if bases[i] else out
        return outs  # type: ignore[return-value]

    def _finished_by(self, req: EngineRequest, base: list[int]) -> FinishReason | None:
        """Whether the ids already emitted complete the request (nothing left to generate)."""
        limit = self.engine.max_model_len
        if len(base) >= req.params.max_tokens or (limit and len(req.prompt_token_ids) + len(base) >= limit):
            return FinishReason.LENGTH
        stops = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stops |= set(getattr(self.engine, "eos_token_ids", ()) or ())
        return FinishReason.STOP if base[-1] in stops else None

    @staticmethod
    def failed(req: TokenizedRequest, error: StageError) -> Generation:
        """The Generation of a request that failed with ``error`` (no output)."""
        finish = {ErrorReason.EXPIRED: FinishReason.EXPIRED, ErrorReason.CANCELLED: FinishReason.CANCELLED}.get(
            error.reason, FinishReason.ERROR)
        return Generation(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_tokens=len(req.prompt_token_ids), finish_reason=finish, error=error, priority=req.priority,
            model=req.model,
        )

    def shutdown(self) -> None:
        self.batcher.stop()
