"""SIMULATED GPU engine: a cost model that sleeps; it computes nothing.

For benchmarks of the pipeline on machines without a GPU. A batch "runs" for::

    prefill_s_per_token * sum(prompt tokens) + steps * step_s(batch_size)
    step_s(b) = step_base_s + step_per_seq_s * (b - 1)

where ``steps`` is the longest output in the batch (``max_tokens`` unless a stop id cut
it short). Batches larger than ``max_batch_size`` run as consecutive chunks. The thread
sleeps, so it uses no CPU. Output ids are deterministic: the prompt's ids, cycled (so they
are valid ids for whatever tokenizer made the prompt).

``SimulatedContinuousEngine`` (``sim_continuous``) charges the same costs step by step, as
vLLM v1 schedules them: a token budget per step (chunked prefill), running requests first,
waiting ones by priority (see its docstring).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmpipe.engines.base import EXTRA_SAMPLING, Engine, EngineOutput, EngineRequest, TokenCallback
from llmpipe.messages import FinishReason

log = logging.getLogger("llmpipe.simulated")


@dataclass(frozen=True)
class SimulatedGpuCost:
    """Costs of a small model on one GPU. Defaults: one 512-token prompt with 64 output
    tokens takes 51.2 ms prefill + 64 * 4.6 ms decode = ~346 ms; 32 such prompts in one
    batch take ~2.2 s (~14 requests/s against ~2.9 one at a time)."""

    prefill_s_per_token: float = 0.0001
    step_base_s: float = 0.0046
    step_per_seq_s: float = 0.00015
    max_batch_size: int = 64
    # The continuous engine's token budget per step (vLLM's max_num_batched_tokens; 2048 is
    # its default for an engine built from AsyncEngineArgs, chunked prefill on).
    max_num_batched_tokens: int = 2048

    def step_s(self, batch_size: int) -> float:
        return self.step_base_s + self.step_per_seq_s * max(0, batch_size - 1)

    def chunk_s(self, prompt_tokens: list[int], output_tokens: list[int]) -> float:
        """Seconds for one chunk (at most ``max_batch_size`` requests)."""
        if not prompt_tokens:
            return 0.0
        return self.prefill_s_per_token * sum(prompt_tokens) + max(output_tokens) * self.step_s(len(prompt_tokens))

    def batch_s(self, prompt_tokens: list[int], output_tokens: list[int]) -> float:
        """Seconds for a batch of any size, run in chunks of ``max_batch_size``."""
        m = self.max_batch_size
        return sum(
            self.chunk_s(prompt_tokens[i : i + m], output_tokens[i : i + m]) for i in range(0, len(prompt_tokens), m)
        )

    def theoretical_capacity_rps(self, prompt_tokens: int, max_tokens: int, batch_size: int) -> float:
        """Requests per second with full batches of identical requests, back to back."""
        b = max(1, batch_size)
        return b / self.batch_s([prompt_tokens] * b, [max_tokens] * b)


class SimulatedGpuEngine(Engine):
    name = "simulated-gpu"
    continuous = False
    unsupported_params = EXTRA_SAMPLING  # its tokens are made up

    def __init__(
        self,
        cost: SimulatedGpuCost | None = None,
        *,
        max_model_len: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cost = cost or SimulatedGpuCost()
        self._max_model_len = max_model_len
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()  # one batch on the "GPU" at a time
        self.batches = 0
        self.requests = 0
        self.busy_s = 0.0

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @staticmethod
    def _tokens(r: EngineRequest) -> tuple[list[int], FinishReason]:
        prompt = r.prompt_token_ids or [0]
        stops = set(r.params.stop_token_ids)
        out: list[int] = []
        for i in range(r.params.max_tokens):
            tok = prompt[i % len(prompt)]
            out.append(tok)
            if tok in stops:
                return out, FinishReason.STOP
        return out, FinishReason.LENGTH

    def generate(self, batch: list[EngineRequest], on_tokens: TokenCallback | None = None) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        m = self.cost.max_batch_size
        with self._lock:
            for start in range(0, len(batch), m):
                chunk = batch[start : start + m]
                results = [self._tokens(r) for r in chunk]
                prompt_lens = [len(r.prompt_token_ids) for r in chunk]
                out_lens = [len(toks) for toks, _ in results]
                t0 = self._clock()
                # Prefill and the first step, then the rest of the decode.
                first = self.cost.prefill_s_per_token * sum(prompt_lens) + self.cost.step_s(len(chunk))
                total = self.cost.chunk_s(prompt_lens, out_lens)
                self._sleep(first)
                first_at = time.time()
                self._sleep(max(0.0, total - first))
                self.busy_s += self._clock() - t0
                self.batches += 1
                self.requests += len(chunk)
                for r, (toks, reason) in zip(chunk, results, strict=True):
                    if on_tokens is not None:
                        on_tokens(r.request_id, list(toks))
                    outputs.append(EngineOutput(r.request_id, toks, reason, first_token_at=first_at, extra={"simulated": True}))
        return outputs

    def stats(self) -> dict[str, float]:
        return {"batches": float(self.batches), "requests": float(self.requests), "busy_s": self.busy_s}

    def shutdown(self) -> None:
        pass


@dataclass
class _Seq:
    req: EngineRequest
    tokens: list[int]
    reason: FinishReason
    done: threading.Event
    produced: int = 0
    prefilled: int = 0  # prompt tokens computed so far (chunked prefill)
    first_at: float | None = None
    cancelled: bool = False
    arrived: float = 0.0  # engine clock: when generate() handed it over
    admitted: float | None = None  # engine clock: when it joined the running set
    finished: float | None = None  # engine clock
    on_tokens: TokenCallback | None = None  # told its tokens after each step, as vLLM streams them

    @property
    def prompt_len(self) -> int:
        return max(1, len(self.req.prompt_token_ids))


class SimulatedContinuousEngine(SimulatedGpuEngine):
    """The same cost model, scheduled step by step as vLLM v1's scheduler does it with
    ``scheduling_policy="priority"`` and chunked prefill (vllm/v1/core/sched/scheduler.py,
    ``Scheduler.schedule``):

    * each step has a budget of ``max_num_batched_tokens`` tokens (vLLM's default for an
      engine built from ``AsyncEngineArgs``: 2048);
    * the running requests are scheduled first, in the order they joined: one token for a
      decode, the rest of the prompt (as much as the budget leaves) for a prefill;
    * then waiting requests join by priority (lower first, then arrival) while budget is
      left and fewer than ``max_batch_size`` (vLLM's ``max_num_seqs``) run; the last one
      may get only a chunk of its prompt;
    * a request emits its first token in the step that computes the last of its prompt,
      then one per step, and ``on_tokens`` hears them after each step (vLLM's outputs);
    * a step costs ``prefill_s_per_token`` per prompt token computed in it plus
      ``step_s(requests in the step)``;
    * no preemption: vLLM preempts (the lowest priority first) only when the KV cache
      cannot hold the next tokens, and the SIMULATED GPU has no KV cache limit. A waiting
      high-priority request does not displace running ones when the running set is full.
    """

    continuous = True

    def __init__(self, cost: SimulatedGpuCost | None = None, *, start: bool = True, **kw) -> None:
        """``start=False``: no scheduler thread; the caller drives the steps in its own time
        (``enqueue``, ``schedule_step``, ``step_cost_s``, ``apply_step``: llmpipe/bench/priority_engine.py)."""
        super().__init__(cost, **kw)
        self._cond = threading.Condition()
        self._waiting: list[tuple[int, int, _Seq]] = []
        self._running: list[_Seq] = []
        self._arrivals = 0
        self._stopped = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="simulated-scheduler", daemon=True)
            self._thread.start()

    @property
    def max_num_seqs(self) -> int:
        return self.cost.max_batch_size

    def enqueue(self, r: EngineRequest, on_tokens: TokenCallback | None = None) -> _Seq:
        """Into the waiting queue; call with the lock held (or without a scheduler thread)."""
        toks, reason = self._tokens(r)
        s = _Seq(r, toks, reason, threading.Event(), arrived=self._clock(), on_tokens=on_tokens)
        heapq.heappush(self._waiting, (r.priority, self._arrivals, s))
        self._arrivals += 1
        return s

    def generate(self, batch: list[EngineRequest], on_tokens: TokenCallback | None = None) -> list[EngineOutput]:
        with self._cond:
            seqs = [self.enqueue(r, on_tokens) for r in batch]
            self._cond.notify_all()
        outs = []
        for s in seqs:
            s.done.wait()
            if s.cancelled:
                outs.append(EngineOutput(s.req.request_id, s.tokens[: s.produced], FinishReason.CANCELLED))
                continue
            if on_tokens is not None:
                on_tokens(s.req.request_id, list(s.tokens))
            outs.append(EngineOutput(s.req.request_id, s.tokens, s.reason, first_token_at=s.first_at,
                                     extra={"simulated": True}))
        return outs

    def abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        with self._cond:
            for s in [*self._running, *(w[2] for w in self._waiting)]:
                if s.req.request_id in ids:
                    s.cancelled = True
            self._cond.notify_all()

    def schedule_step(self) -> list[tuple[_Seq, int]]:
        """One step's schedule, (request, tokens) pairs; call with the lock held. Moves the
        waiting requests it admits into the running set."""
        budget = self.cost.max_num_batched_tokens
        step: list[tuple[_Seq, int]] = []
        for s in self._running:
            if budget <= 0:
                break
            n = min(budget, s.prompt_len - s.prefilled) if s.prefilled < s.prompt_len else 1
            step.append((s, n))
            budget -= n
        while self._waiting and budget > 0 and len(self._running) < self.cost.max_batch_size:
            s = heapq.heappop(self._waiting)[2]
            s.admitted = self._clock()
            self._running.append(s)
            n = min(budget, s.prompt_len)
            step.append((s, n))
            budget -= n
        return step

    def step_cost_s(self, step: list[tuple[_Seq, int]]) -> float:
        prefill = sum(n for s, n in step if s.prefilled < s.prompt_len)
        return self.cost.prefill_s_per_token * prefill + self.cost.step_s(len(step))

    def _finish(self, s: _Seq) -> None:
        self.requests += 1
        s.finished = end = self._clock()
        s.done.set()
        if not s.cancelled and s.admitted is not None:
            # Where its engine time went (benchmarks read it from the worker's log).
            log.info("simulated request=%s priority=%d engine_wait_s=%.3f engine_run_s=%.3f",
                     s.req.request_id, s.req.priority, s.admitted - s.arrived, end - s.admitted)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._running and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    for s in [*self._running, *(w[2] for w in self._waiting)]:
                        s.cancelled = True
                        s.done.set()
                    return
                # Aborted requests leave before the step (vLLM frees them at once).
                for s in [s for s in self._running if s.cancelled]:
                    self._running.remove(s)
                    self._finish(s)
                gone = [w for w in self._waiting if w[2].cancelled]
                if gone:
                    self._waiting = [w for w in self._waiting if not w[2].cancelled]
                    heapq.heapify(self._waiting)
                    for w in gone:
                        self._finish(w[2])
                step = self.schedule_step()
                if not step:
                    continue
                cost_s = self.step_cost_s(step)
            t0 = self._clock()
            self._sleep(cost_s)
            now = time.time()
            with self._cond:
                self.busy_s += self._clock() - t0
                produced = self.apply_step(step, now)
            self._tell(produced)

    def apply_step(self, step: list[tuple[_Seq, int]], now: float) -> list[tuple[_Seq, list[int]]]:
        """What a step computed; call with the lock held. Finished requests leave (generate
        hands them their tokens); returns the others that made a token, with their tokens so far."""
        self.batches += 1
        produced = []
        for s, n in step:
            if s.prefilled < s.prompt_len:
                s.prefilled += n
                if s.prefilled < s.prompt_len:
                    continue  # a chunk of its prompt: no token yet
            s.produced += 1
            if s.first_at is None:
                s.first_at = now
            if s.cancelled or s.produced >= len(s.tokens):
                self._running.remove(s)
                self._finish(s)
            elif s.on_tokens is not None:
                produced.append((s, s.tokens[: s.produced]))
        return produced

    @staticmethod
    def _tell(produced: list[tuple[_Seq, list[int]]]) -> None:
        """The step's tokens to their callbacks, outside the lock; a failing one hears no more."""
        for s, toks in produced:
            try:
                s.on_tokens(s.req.request_id, toks)
            except Exception:
                s.on_tokens = None
                log.exception("on_tokens callback failed for %s; no more callbacks for it", s.req.request_id)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
