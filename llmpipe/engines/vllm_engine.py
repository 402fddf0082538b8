"""vLLM v1 ``AsyncLLM`` behind the Engine interface, with continuous batching.

The ``AsyncLLM`` lives on an asyncio event loop in a daemon thread owned by the engine.
``generate`` (blocking, thread-safe) schedules one coroutine per request on that loop, so
requests from concurrent ``generate`` calls join vLLM's running batch.

The engine never tokenizes or detokenizes: prompts are ``TokensPrompt(prompt_token_ids=...)``
and outputs token ids (``detokenize=False``). vLLM loads the model's tokenizer only because
its structured outputs (``response_format``) compile grammars over the vocabulary: with
``skip_tokenizer_init`` it refuses them. We add the model's EOS ids (generation_config.json,
then config.json) to the stop token ids ourselves too, so generation stops at EOS whatever
vLLM version does (unless ``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import Counter
from typing import Any

from llmpipe.engines import vllm_core_guard
from llmpipe.engines.base import Engine, EngineOutput, EngineRequest, TokenCallback
from llmpipe.engines.platform import cpu_environment
from llmpipe.engines.vllm_args import OWNED, SKIP_TOKENIZER_INIT, built_args
from llmpipe.engines.vllm_convert import (
    FINISH,
    StatsSink,
    as_id_list,
    is_transient,
    position,
    prompt_positions,
    sampling_params,
    stop_token,
)
from llmpipe.errors import EngineBadRequestError, EngineDeadError, EngineError
from llmpipe.messages import FinishReason, Logprob, SamplingParams
from llmpipe.observability.heap import collector_paused
from llmpipe.observability.metrics import ENGINE_ABORTS

log = logging.getLogger(__name__)

def _on_cpu() -> bool:
    """True when vLLM will run on CPU (decided before vLLM is imported)."""
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch always present with vLLM
        return True


class VllmEngine(Engine):
    name = "vllm"
    continuous = True
    supports_logprobs = True
    supports_structured_outputs = True

    def __init__(
        self,
        model: str,
        *,
        kv_cache_gib: float = 1.0,
        start_timeout_s: float = 900.0,
        reasoning_parser: str | None = None,
        **engine_args: Any,
    ) -> None:
        """``engine_args``: vLLM AsyncEngineArgs fields (dtype, max_model_len, enforce_eager,
        max_num_seqs, tensor_parallel_size, ...); llmpipe/engines/platform.py chooses them.
        A None value leaves vLLM's own default. ``reasoning_parser``: the model's (the
        reasoning_parser setting), which vLLM's structured outputs wait for, as vllm serve's."""
        owned = sorted(set(engine_args) & set(OWNED))
        if owned:
            raise EngineError(f"engine argument {owned[0]} is set by the pipeline: {OWNED[owned[0]]}")
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        with collector_paused():  # torch's and vLLM's imports build a heap this worker keeps (heap.py)
            self._on_cpu = _on_cpu()
            if self._on_cpu:
                for name, value in cpu_environment(kv_cache_gib).items():
                    os.environ.setdefault(name, value)  # a variable the user set wins
            from vllm.engine.arg_utils import AsyncEngineArgs

            vllm_core_guard.install()  # no orphaned engine core when this worker is killed
        self._model = model
        args = built_args(engine_args, kv_cache_gib=kv_cache_gib, on_cpu=self._on_cpu)
        try:
            # The tokenizer is loaded for structured outputs only; prompts stay token ids (vllm_args.py).
            owned_args = {"reasoning_parser": reasoning_parser} if reasoning_parser else {}
            self._args = AsyncEngineArgs(model=model, skip_tokenizer_init=SKIP_TOKENIZER_INIT, **owned_args, **args)
        except Exception as e:
            raise EngineError(f"bad vLLM engine arguments for {model!r}: {type(e).__name__}: {e}") from e
        # vLLM refuses a non-zero priority under fcfs (scheduling_policy set by an engine argument).
        self._priorities = getattr(self._args, "scheduling_policy", "fcfs") == "priority"
        self._stats = StatsSink()
        self._lock = threading.Lock()
        self._inflight: Counter[str] = Counter()
        self._cancelled: set[str] = set()
        self._futures: set[concurrent.futures.Future] = set()
        self._closed = False
        self._llm: Any = None
        self._max_model_len: int | None = None
        self._max_num_seqs: int | None = None
        self._block_size: int | None = None
        self._vocab_size = 0
        self._eos_ids: list[int] = []
        with collector_paused():  # AsyncLLM's import and start, as above
            self._start_loop_and_engine(model, start_timeout_s)

    def _start_loop_and_engine(self, model: str, start_timeout_s: float) -> None:
        """The loop thread, then AsyncLLM on it; a failed start stops what it started."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        started = time.monotonic()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=start_timeout_s)
        except BaseException as e:
            self._closed = True
            if self._llm is not None:  # started, then failed (or the start timed out)
                try:
                    self._llm.shutdown()
                except Exception:
                    log.warning("vLLM shutdown after a failed start failed", exc_info=True)
            self._stop_loop()
            raise EngineError(f"vLLM failed to start for {model!r}: {type(e).__name__}: {e}") from e
        self.start_s = time.monotonic() - started
        log.info("vLLM engine ready in %.1fs (model=%s, eos=%s)", self.start_s, model, self._eos_ids)

    # -- loop thread ---------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _start(self) -> None:
        # Created on the loop so that AsyncLLM's output handler runs on it.
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        # vllm serve's context: the defaults it picks (max_num_seqs, max_num_batched_tokens).
        self._llm = AsyncLLM.from_engine_args(self._args, usage_context=UsageContext.OPENAI_API_SERVER,
                                              stat_loggers=[self._stats.factory])
        mc = self._llm.model_config
        cc = self._llm.vllm_config.cache_config
        # where prefix-cache hits land, in tokens (prefix-aware routing hashes prompts by it)
        self._block_size = int(getattr(cc, "hash_block_size", None) or cc.block_size)
        self._max_model_len = int(mc.max_model_len)
        self._max_num_seqs = int(self._llm.vllm_config.scheduler_config.max_num_seqs)
        self._vocab_size = int(mc.get_vocab_size())
        eos: list[int] = []
        try:
            eos += as_id_list(mc.try_get_generation_config().get("eos_token_id"))
        except Exception:  # pragma: no cover - defensive
            log.warning("could not read the generation config of %s", self._model, exc_info=True)
        eos += as_id_list(getattr(mc.hf_text_config, "eos_token_id", None))
        self._eos_ids = sorted(set(eos))
        if not self._eos_ids:
            log.warning("model %s declares no eos_token_id; generation stops at max_tokens or stop ids", self._model)

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._loop.is_running() and not self._thread.is_alive():
            self._loop.close()

    # -- properties ------------------------------------------------------------------

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @property
    def block_size(self) -> int | None:
        """The engine's KV-cache block in tokens: its prefix cache holds whole blocks."""
        return self._block_size

    @property
    def max_num_seqs(self) -> int | None:
        """vLLM's running set: as it resolved it once started (its own default where unset)."""
        return self._max_num_seqs or getattr(self._args, "max_num_seqs", None)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    # -- generation ------------------------------------------------------------------

    def _sampling_params(self, p: SamplingParams) -> Any:
        return sampling_params(p, self._eos_ids)

    async def _run_one(self, req: EngineRequest, on_tokens: TokenCallback | None) -> EngineOutput:
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt

        rid = req.request_id
        if rid in self._cancelled:
            return EngineOutput(rid, [], FinishReason.CANCELLED)
        logprobs: list[list[Logprob]] | None = [] if req.params.logprobs is not None else None
        prompt_logprobs: list[list[Logprob]] | None = None
        tokens: list[int] = []
        first_at: float | None = None
        finish: str | None = None
        stop_reason: Any = None
        abort_sent = False
        callback_ok = on_tokens is not None
        try:
            gen = self._llm.generate(TokensPrompt(prompt_token_ids=list(req.prompt_token_ids)),
                                     self._sampling_params(req.params), rid,
                                     priority=req.priority if self._priorities else 0,
                                     reasoning_ended=req.reasoning_ended)
            async for out in gen:
                comp = out.outputs[0]
                if out.prompt_logprobs and prompt_logprobs is None:
                    prompt_logprobs = prompt_positions(req.prompt_token_ids, out.prompt_logprobs)
                if logprobs is not None and comp.logprobs:
                    logprobs.extend(position(pos) for pos in comp.logprobs)
                if comp.token_ids:
                    if first_at is None:
                        first_at = time.time()
                    tokens.extend(comp.token_ids)
                    if callback_ok:
                        try:
                            on_tokens(rid, list(tokens))
                        except Exception:
                            callback_ok = False
                            log.exception("on_tokens callback failed for %s; no more callbacks for it", rid)
                if comp.finish_reason is not None:
                    finish = str(comp.finish_reason)
                    stop_reason = comp.stop_reason
                # (No break on out.finished: vLLM's generator ends by itself after it; leaving
                # it suspended would make its finaliser abort the finished request.)
                if not out.finished and rid in self._cancelled and not abort_sent:
                    # abort() raced with the request being added; abort it now that it exists.
                    abort_sent = True
                    await self._llm.abort(rid)
                    ENGINE_ABORTS.inc()
        except VLLMValidationError as e:  # what the request asks, e.g. a schema the grammar backend refuses
            raise EngineBadRequestError(f"request {rid}: {e}", param=e.parameter) from e
        if finish == "error":
            raise EngineError(f"vLLM reported a request-level error for {rid}", transient=True)
        reason = FINISH.get(finish or "", FinishReason.CANCELLED if rid in self._cancelled else FinishReason.LENGTH)
        extra: dict[str, Any] = {}
        if stop_reason is not None:
            extra["stop_reason"] = stop_reason
        return EngineOutput(rid, tokens, reason, first_token_at=first_at, extra=extra, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, stop_token=stop_token(stop_reason))

    def _translate(self, exc: BaseException) -> EngineError:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        if isinstance(exc, EngineError):
            return exc
        if isinstance(exc, VllmEngineDeadError) or (self._llm is not None and self._llm.errored):
            return EngineDeadError(f"vLLM engine core is dead: {exc}")
        if isinstance(exc, (concurrent.futures.CancelledError, asyncio.CancelledError)):
            return EngineDeadError("vLLM engine is shut down")
        cause = exc.__cause__ or exc
        return EngineError(f"vLLM failed a request: {type(cause).__name__}: {cause}", transient=is_transient(exc))

    def _validate(self, r: EngineRequest) -> None:
        # vLLM range-checks prompt ids against its tokenizer at most (none with
        # skip_tokenizer_init), and an id outside the model's vocabulary kills the engine
        # core (IndexError in the embedding). Check them here, whatever vLLM does.
        ids = r.prompt_token_ids
        if not ids:
            raise EngineError(f"request {r.request_id}: the prompt is empty")
        if len(ids) >= self._max_model_len:
            raise EngineError(
                f"request {r.request_id}: prompt of {len(ids)} tokens leaves no room in max_model_len {self._max_model_len}"
            )
        if min(ids) < 0 or max(ids) >= self._vocab_size:
            raise EngineError(f"request {r.request_id}: a token id is out of vocabulary (size {self._vocab_size})")

    def generate(self, batch: list[EngineRequest], on_tokens: TokenCallback | None = None) -> list[EngineOutput]:
        if not batch:
            return []
        for r in batch:
            self._validate(r)
        with self._lock:
            if self._closed:
                raise EngineDeadError("vLLM engine is shut down")
            if self._llm is None or self._llm.errored:
                raise EngineDeadError("vLLM engine core is dead")
            futures = [asyncio.run_coroutine_threadsafe(self._run_one(r, on_tokens), self._loop) for r in batch]
            self._futures.update(futures)
            for r in batch:
                self._inflight[r.request_id] += 1
        try:
            try:
                concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            except BaseException:
                # Interrupted (time limit, KeyboardInterrupt): stop the whole batch.
                self._abort_pending(batch, futures)
                raise
            failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception() is not None), None)
            if failed is None and not any(f.cancelled() for f in futures):
                return [f.result() for f in futures]
            # One request failed (or the engine shut down): stop the rest, fail the batch.
            self._abort_pending(batch, futures)
            exc = failed.exception() if failed is not None else concurrent.futures.CancelledError()
            raise self._translate(exc) from exc
        finally:
            with self._lock:
                self._futures.difference_update(futures)
                for r in batch:
                    self._inflight[r.request_id] -= 1
                    if self._inflight[r.request_id] <= 0:
                        del self._inflight[r.request_id]
                        self._cancelled.discard(r.request_id)

    def _abort_pending(self, batch: list[EngineRequest], futures: list[concurrent.futures.Future]) -> None:
        pending = [r.request_id for r, f in zip(batch, futures, strict=True) if not f.done()]
        for f in futures:
            f.cancel()  # cancels the task on the loop; vLLM's generate() aborts the request
        if pending:
            self.abort(pending)

    def abort(self, request_ids: list[str]) -> None:
        with self._lock:
            ids = [r for r in request_ids if r in self._inflight]
            self._cancelled.update(ids)
            if not ids or self._closed or not self._loop.is_running():
                return
        asyncio.run_coroutine_threadsafe(self._abort(ids), self._loop)

    async def _abort(self, ids: list[str]) -> None:
        try:
            await self._llm.abort(ids)
        except Exception:
            log.warning("vLLM abort of %s failed", ids, exc_info=True)
        else:
            ENGINE_ABORTS.inc(len(ids))

    def stats(self) -> dict[str, float]:
        with self._lock:
            inflight = float(sum(self._inflight.values()))
        s = self._stats.latest
        if s is None:
            return {"running": inflight, "waiting": 0.0, "inflight": inflight}
        return {
            "running": float(s.num_running_reqs),
            "waiting": float(s.num_waiting_reqs),
            "kv_cache_usage": float(s.kv_cache_usage),
            "inflight": inflight,
            "prefix_cache_queries": float(self._stats.prefix_queries),
            "prefix_cache_hits": float(self._stats.prefix_hits),
        }

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            futures = list(self._futures)
        for f in futures:
            f.cancel()
        if self._loop.is_running() and self._llm is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._ashutdown(), self._loop).result(timeout=60)
            except Exception:
                log.warning("vLLM shutdown failed", exc_info=True)
        self._stop_loop()

    async def _ashutdown(self) -> None:
        await asyncio.sleep(0)  # let cancelled request tasks run their abort first
        llm, self._llm = self._llm, None
        llm.shutdown()
