"""A plain transformers engine: one static batch at a time, no vLLM needed.

Its dtype and device follow the platform rule (llmpipe/engines/platform.py): bf16 on a
GPU, float32 on the CPU. A batch is one padded tensor with its attention mask: one
batched prefill, then one batched forward per generated token. A model folder marked as
random-weight (llmpipe/models/random_llama.py) is built from its config on the device.

The decode loop is our own (prefill once with left padding, then one token per step with
the KV cache), so that every request of a batch keeps its own sampling parameters,
``max_tokens`` and stop ids, and ``on_tokens`` is called after every step.

Sampling, with vLLM's semantics (llmpipe/engines/hf_sampling.py): allowed_token_ids,
bad_words, min_tokens, logit_bias and the repetition, frequency and presence penalties
process the logits; ``temperature == 0`` is greedy (the same argmax as vLLM, so greedy ids
match vLLM's on the same float32 weights), otherwise temperature, min_p, top_k and top_p.
A request with a ``seed`` draws from its own ``torch.Generator`` seeded with it, so it is
reproducible with this engine whatever else is in the batch; the draws are NOT the same as
vLLM's for the same seed. Unseeded requests share one generator seeded at start-up. Guided
decoding (structured outputs) is vLLM's only: such a request is refused (supports_structured_outputs).

Log probabilities, as vLLM computes them by default (``raw_logprobs``): the log-softmax of
the model's logits before temperature and top-p, with the sampled token's rank and the top
``logprobs`` tokens; prompt logprobs from a prefill that keeps every position's logits.

Each batch logs one line, its time to the first token and per decode step, as wall time
and as the engine thread's CPU time (llmpipe/engines/batch_timing.py; ``last_batch``).

Like vLLM: generation stops at an EOS id of the model (generation_config.json, then
config.json) unless ``ignore_eos``, or at a ``stop_token_ids`` id; the stop token is part
of the output. Output is capped so that prompt + output <= ``max_model_len``; a prompt
that leaves no room (or is empty, or holds an id outside the vocabulary) is an EngineError.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmpipe.engines import hf_sampling
from llmpipe.engines.base import Engine, EngineOutput, EngineRequest, TokenCallback
from llmpipe.engines.batch_timing import BatchTimer, BatchTiming, log_line
from llmpipe.errors import EngineDeadError, EngineError
from llmpipe.messages import FinishReason, Logprob
from llmpipe.models.random_llama import is_random_weights
from llmpipe.observability.metrics import ENGINE_ABORTS

log = logging.getLogger(__name__)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _torch_dtype(torch: Any, dtype: str) -> Any:
    if dtype in ("auto", "", None):
        return "auto"
    aliases = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}
    name = aliases.get(dtype, dtype)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise EngineError(f"unknown dtype {dtype!r}")
    return value


def _load(torch: Any, auto: Any, model: str, dtype: Any, device: str, seed: int) -> Any:
    """A checkpoint, or a random-weight model built on ``device`` from its config
    (llmpipe/models/random_llama.py): no weights to read, and no copy from the CPU."""
    if not is_random_weights(model):
        return auto.from_pretrained(model, dtype=dtype).to(device)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return auto.from_config(config, dtype=dtype)


@dataclass
class _Decoding:
    """Per request of one batch: its token limit and stop ids, and what it generated so far."""

    limits: list[int]
    stops: list[set[int]]
    want_lp: list[bool]
    tokens: list[list[int]]
    reasons: list[FinishReason | None]
    first_at: list[float | None]
    logprobs: list[list[list[Logprob]] | None]
    prompt_lp: list[list[list[Logprob]] | None]


class TransformersEngine(Engine):
    name = "transformers"
    continuous = False
    supports_logprobs = True

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        device: str | None = None,
        max_model_len: int | None = None,
        max_batch_size: int = 32,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        started = time.monotonic()
        try:
            self._model = _load(torch, AutoModelForCausalLM, model, _torch_dtype(torch, dtype), self.device, seed)
            self._model.eval()
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"transformers failed to load {model!r}: {type(e).__name__}: {e}") from e
        cfg = self._model.config
        gen = getattr(self._model, "generation_config", None)
        self._eos_ids = sorted(set(_ids(getattr(gen, "eos_token_id", None)) + _ids(getattr(cfg, "eos_token_id", None))))
        pad = getattr(gen, "pad_token_id", None)
        if pad is None:
            pad = getattr(cfg, "pad_token_id", None)
        if pad is None:
            pad = self._eos_ids[0] if self._eos_ids else 0
        self._pad_id = int(pad)
        self._vocab_size = int(cfg.vocab_size)
        own_len = getattr(cfg, "max_position_embeddings", None)
        self._max_model_len = int(max_model_len or own_len or 2048)
        self._max_batch_size = max(1, int(max_batch_size))
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._running: set[str] = set()
        self._clock, self._cpu_clock = clock, cpu_clock
        self.last_batch: BatchTiming | None = None  # also logged, one line per batch
        self.start_s = time.monotonic() - started
        log.info("transformers engine ready in %.1fs (model=%s, device=%s)", self.start_s, model, self.device)

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    def abort(self, request_ids: list[str]) -> None:
        self._cancelled.update(r for r in request_ids if r in self._running)

    def stats(self) -> dict[str, float]:
        return {"running": float(len(self._running))}

    def shutdown(self) -> None:
        with self._lock:
            self._model = None
            if self._torch.cuda.is_available():
                self._torch.cuda.empty_cache()

    def generate(self, batch: list[EngineRequest], on_tokens: TokenCallback | None = None) -> list[EngineOutput]:
        if not batch:
            return []
        for r in batch:
            self._validate(r)
        with self._lock:
            if self._model is None:
                raise EngineDeadError("transformers engine is shut down")
            outputs: list[EngineOutput] = []
            for start in range(0, len(batch), self._max_batch_size):
                chunk = batch[start : start + self._max_batch_size]
                self._running.update(r.request_id for r in chunk)
                try:
                    outputs.extend(self._run(chunk, on_tokens))
                except EngineError:
                    raise
                except Exception as e:
                    oom = "out of memory" in str(e).lower() or isinstance(e, getattr(self._torch, "OutOfMemoryError", ()))
                    raise EngineError(f"transformers failed a batch: {type(e).__name__}: {e}", transient=oom) from e
                finally:
                    self._running.difference_update(r.request_id for r in chunk)
                    self._cancelled.difference_update(r.request_id for r in chunk)
            return outputs

    def _validate(self, r: EngineRequest) -> None:
        n = len(r.prompt_token_ids)
        if n == 0:
            raise EngineError(f"request {r.request_id}: the prompt is empty")
        if n >= self._max_model_len:
            raise EngineError(
                f"request {r.request_id}: prompt of {n} tokens leaves no room in max_model_len {self._max_model_len}"
            )
        if min(r.prompt_token_ids) < 0 or max(r.prompt_token_ids) >= self._vocab_size:
            raise EngineError(f"request {r.request_id}: a token id is out of vocabulary")

    def _run(self, batch: list[EngineRequest], on_tokens: TokenCallback | None) -> list[EngineOutput]:
        torch = self._torch
        input_ids, attn, positions, width = self._prompt_inputs(batch)
        timer = BatchTimer(len(batch), width, clock=self._clock, cpu_clock=self._cpu_clock)
        st = self._decoding(batch)
        gens = [
            torch.Generator(device=self.device).manual_seed(r.params.seed) if r.params.seed is not None else self._generator
            for r in batch
        ]
        keep_all = any(r.params.prompt_logprobs is not None for r in batch)
        with torch.inference_mode():
            out = self._model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True,
                              logits_to_keep=0 if keep_all else 1)
            past = out.past_key_values
            if keep_all:
                for i, r in enumerate(batch):
                    if r.params.prompt_logprobs is not None:
                        st.prompt_lp[i] = self._prompt_logprobs(out.logits[i], r.prompt_token_ids, width,
                                                                r.params.prompt_logprobs)
            logits = out.logits[:, -1, :]
            for _ in range(max(st.limits)):
                chosen = self._choose(logits, batch, gens, st)
                timer.first_token()  # the first choice waits for the prefill
                lps = torch.log_softmax(logits.float(), dim=-1) if any(st.want_lp) else None
                self._record(st, batch, chosen, lps, on_tokens)
                if all(x is not None for x in st.reasons):
                    break
                feed = torch.tensor([t[-1] if t else self._pad_id for t in st.tokens], dtype=torch.long,
                                    device=self.device)
                attn = torch.cat([attn, attn.new_ones((len(batch), 1))], dim=1)
                positions = positions[:, -1:] + 1
                out = self._model(
                    input_ids=feed[:, None], attention_mask=attn, position_ids=positions, past_key_values=past, use_cache=True
                )
                past = out.past_key_values
                logits = out.logits[:, -1, :]
                timer.step()
        self.last_batch = timer.done()
        log.info("%s", log_line(self.last_batch))
        return [
            EngineOutput(r.request_id, st.tokens[i], st.reasons[i] or FinishReason.LENGTH, first_token_at=st.first_at[i],
                         logprobs=st.logprobs[i], prompt_logprobs=st.prompt_lp[i],
                         stop_token=st.tokens[i][-1] if st.reasons[i] is FinishReason.STOP and st.tokens[i]
                         and st.tokens[i][-1] in r.params.stop_token_ids else None)
            for i, r in enumerate(batch)
        ]

    def _prompt_inputs(self, batch: list[EngineRequest]) -> tuple[Any, Any, Any, int]:
        """The batch's prompts left-padded to one width: (input ids, attention mask, positions, width)."""
        torch = self._torch
        b = len(batch)
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((b, width), self._pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            input_ids[i, width - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            attn[i, width - n :] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        return input_ids, attn, positions, width

    def _decoding(self, batch: list[EngineRequest]) -> _Decoding:
        want_lp = [r.params.logprobs is not None for r in batch]
        return _Decoding(
            limits=[min(r.params.max_tokens, self._max_model_len - len(r.prompt_token_ids)) for r in batch],
            stops=[set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(self._eos_ids)) for r in batch],
            want_lp=want_lp, tokens=[[] for _ in batch], reasons=[None] * len(batch), first_at=[None] * len(batch),
            logprobs=[[] if w else None for w in want_lp], prompt_lp=[None] * len(batch))

    def _record(self, st: _Decoding, batch: list[EngineRequest], chosen: list[int], lps: Any,
                on_tokens: TokenCallback | None) -> None:
        """One decode step's token for every request still generating, and why one ends."""
        now = time.time()
        for i, r in enumerate(batch):
            if st.reasons[i] is not None:
                continue
            if r.request_id in self._cancelled:
                st.reasons[i] = FinishReason.CANCELLED
                ENGINE_ABORTS.inc()
                continue
            tok = chosen[i]
            st.tokens[i].append(tok)
            if st.want_lp[i]:
                st.logprobs[i].append(_position(lps[i], tok, r.params.logprobs))
            if st.first_at[i] is None:
                st.first_at[i] = now
            if tok in st.stops[i]:
                st.reasons[i] = FinishReason.STOP
            elif len(st.tokens[i]) >= st.limits[i]:
                st.reasons[i] = FinishReason.LENGTH
            if on_tokens is not None:
                try:
                    on_tokens(r.request_id, list(st.tokens[i]))
                except Exception:
                    log.exception("on_tokens callback failed for %s", r.request_id)

    def _prompt_logprobs(self, logits: Any, ids: list[int], width: int, k: int) -> list[list[Logprob]]:
        """Logprobs of each prompt token given those before it; the first has none."""
        n = len(ids)
        lps = self._torch.log_softmax(logits[width - n : width - 1].float(), dim=-1)
        return [[Logprob(id=ids[0])]] + [_position(lps[j - 1], ids[j], k) for j in range(1, n)]

    def _choose(self, logits: Any, batch: list[EngineRequest], gens: list[Any], st: _Decoding) -> list[int]:
        torch = self._torch
        logits = logits.float()
        chosen = logits.argmax(dim=-1).tolist()
        for i, r in enumerate(batch):
            p = r.params
            if st.reasons[i] is not None:
                continue
            row = logits[i]
            if hf_sampling.needs_processing(p):
                row = hf_sampling.process(torch, row.clone(), p, r.prompt_token_ids, st.tokens[i], st.stops[i])
                chosen[i] = int(row.argmax().item())
            if p.temperature != 0:
                chosen[i] = hf_sampling.draw(torch, row, p, gens[i])
        return chosen


def _position(lps: Any, token: int, k: int) -> list[Logprob]:
    """One position as vLLM lists it: ``token`` with its rank (how many tokens are at least
    as likely), then the top ``k`` not already listed. -inf is written as -9999.0, as vLLM does."""
    lp = float(lps[token])
    out = [Logprob(id=token, logprob=max(lp, -9999.0), rank=int((lps >= lps[token]).sum()))]
    if k == -1:
        k = lps.numel()
    if k > 0:
        values, idx = lps.topk(k)
        for rank, (t, v) in enumerate(zip(idx.tolist(), values.tolist(), strict=True), start=1):
            if t != token:
                out.append(Logprob(id=t, logprob=max(v, -9999.0), rank=rank))
    return out
