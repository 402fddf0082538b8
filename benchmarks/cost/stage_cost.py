"""llmpipe's own CPU per request, stage by stage, in one process.

    python -m benchmarks.cost.stage_cost [--model smollm2] [--requests 300]

Runs each request's three stage tasks (preprocess, inference on the no-op engine,
postprocess as a single-prompt job's last hop) by calling them directly, as a worker's
pool process would, against a Redis of its own and the model's tokenizer: no broker, no
Celery worker, no HTTP. That is the work the celery floor's tasks do not do,
measured without the contention of a loaded machine: ``time.process_time``, so the
inference figure includes the batcher's thread. docs/benchmarks.md has a run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

STAGES = ("preprocess", "inference", "postprocess")


def measure(model: str, requests: int, prompt_tokens: int, max_tokens: int, warm: int = 20) -> dict[str, float]:
    """Mean CPU ms per request of each stage task, the tokenizer call alone, and one Redis
    round trip (PING), for ``requests`` requests after ``warm`` unmeasured ones."""
    from llmpipe.local.redis_server import EmbeddedRedis

    with tempfile.TemporaryDirectory(prefix="llmpipe-stage-cost-") as tmp:
        server = EmbeddedRedis(Path(tmp), appendonly=False).start()
        try:
            return _measure(server.url, model, requests, prompt_tokens, max_tokens, warm)
        finally:
            server.stop()


def _measure(redis_url: str, model: str, requests: int, prompt_tokens: int, max_tokens: int, warm: int) -> dict[str, float]:
    # The task modules read the process's settings: this process is the worker here.
    os.environ.update(LLMPIPE_REDIS_URL=redis_url, LLMPIPE_MODEL=model, LLMPIPE_ENGINE="noop")
    from llmpipe.settings import get_settings
    from workers.context import context, reset_context

    get_settings.cache_clear()
    reset_context()
    from llmpipe.bench.prompts import make_prompts
    from llmpipe.messages import PromptRequest, SamplingParams
    from tasks.inference import inference
    from tasks.postprocess import postprocess
    from tasks.preprocess import preprocess

    ctx = context()
    try:
        resources = ctx.model(None)
        prompts = make_prompts(resources.tokenizer_owner.get(), warm + requests, prompt_tokens)

        def request(prompt: str) -> tuple[str, dict]:
            job_id = uuid.uuid4().hex
            now = time.time()
            ctx.jobs.create(job_id, n_prompts=1, deadline=now + 600)
            msg = PromptRequest(job_id=job_id, index=0, deadline=now + 600, enqueued_at=now, prompt=prompt,
                                params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            return job_id, msg.model_dump(mode="json", exclude_none=True)

        spent = dict.fromkeys(STAGES, 0.0)

        def timed(stage: str, call: Callable[[], dict]) -> dict:
            t0 = time.process_time()
            out = call()
            spent[stage] += time.process_time() - t0
            return out

        for i, prompt in enumerate(prompts):
            if i == warm:
                spent = dict.fromkeys(STAGES, 0.0)
            job_id, msg = request(prompt)
            tokenized = timed("preprocess", lambda: preprocess(msg))
            generated = timed("inference", lambda: inference(tokenized))
            result = timed("postprocess", lambda: postprocess(generated, job_id=job_id, submitted_at=time.time()))
            if result.get("status") != "succeeded":
                raise RuntimeError(f"job {job_id} ended {result.get('status')}: {result.get('error')}")
        ms = {stage: 1e3 * spent[stage] / requests for stage in STAGES}
        ms["total"] = sum(ms[s] for s in STAGES)
        processor = resources.input_processor
        ms["tokenizer call"] = _mean_ms(lambda p: processor.prompt_ids(p), prompts[warm:])
        ms["redis round trip"] = _mean_ms(lambda _: ctx.redis.ping(), prompts[warm:])
        return ms
    finally:
        reset_context()


def _mean_ms(call: Callable[[str], object], items: list[str]) -> float:
    t0 = time.process_time()
    for item in items:
        call(item)
    return 1e3 * (time.process_time() - t0) / len(items)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="served model: smollm2, tiny, or a local folder")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    a = ap.parse_args(argv)
    ms = measure(a.model, a.requests, a.prompt_tokens, a.max_tokens)
    if a.json:
        print(json.dumps(ms))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"CPU per request in one process: {a.requests} requests of ~{a.prompt_tokens} tokens, "
                  f"{a.max_tokens} tokens out, no-op engine, model {a.model}")
    table = Table("what", "ms")
    for what, value in ms.items():
        table.add_row(what, f"{value:.3f}")
    console.print(table)


if __name__ == "__main__":
    main()
