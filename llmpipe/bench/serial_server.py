"""The "serial" baseline of the benchmark: one process that tokenizes, generates and
detokenizes one request at a time, behind a small HTTP server.

It speaks the pipeline's job API (``POST /v1/jobs``, ``GET /v1/jobs/{id}?wait=``, with the
same result fields) and ``POST /v1/completions`` (OpenAI style, ``stream`` supported), so
the load generator drives it exactly like the pipeline. One worker thread takes requests
from a FIFO queue strictly one at a time: tokenizer (the same call as the preprocess
stage), the same engine class as the pipeline (``create_engine``), then detokenize; the
simulated CPU burn of the pre/post stages applies here too.

    python -m llmpipe.bench.serial_server --port 8100    # settings from LLMPIPE_* env
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from llmpipe.bench.burn import burn_cpu
from llmpipe.settings import Settings


class JobBody(BaseModel):
    prompt: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    timeout: float | None = None


class CompletionBody(JobBody):
    model: str | None = None
    stream: bool = False
    stream_options: dict | None = None


@dataclass
class Job:
    id: str
    body: JobBody
    loop: asyncio.AbstractEventLoop
    created_at: float = field(default_factory=time.time)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    status: str = "queued"
    result: dict | None = None
    error: str | None = None
    deltas: asyncio.Queue | None = None  # streamed text pieces; None ends the stream


class SerialServer:
    def __init__(self, settings: Settings):
        from transformers import AutoTokenizer

        from llmpipe.engines.factory import create_engine
        from llmpipe.models.registry import resolve_model

        self.s = settings
        path = resolve_model(settings.model, settings.models_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.engine = create_engine(settings, path)
        self.jobs: dict[str, Job] = {}
        self.q: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="serial-worker", daemon=True)
        self.thread.start()

    def submit(self, body: JobBody, *, stream: bool = False) -> Job:
        job = Job(uuid.uuid4().hex, body, asyncio.get_running_loop())
        if stream:
            job.deltas = asyncio.Queue()
        self.jobs[job.id] = job
        while len(self.jobs) > 50_000:  # finished jobs stay readable for a while
            self.jobs.pop(next(iter(self.jobs)))
        self.q.put(job)
        return job

    def _work(self) -> None:
        while (job := self.q.get()) is not None:
            try:
                job.result = self._run(job)
                job.status = "succeeded"
            except Exception as e:  # report, keep serving
                job.status, job.error = "failed", f"{type(e).__name__}: {e}"
            job.loop.call_soon_threadsafe(job.done.set)
            if job.deltas is not None:
                job.loop.call_soon_threadsafe(job.deltas.put_nowait, None)

    def _run(self, job: Job) -> dict:
        from llmpipe.engines.base import EngineRequest
        from llmpipe.messages import SamplingParams

        b = job.body
        t_pre = time.time()
        burn_cpu(self.s.sim_preprocess_cpu_ms)
        ids = list(self.tokenizer(b.prompt, add_special_tokens=True, split_special_tokens=True)["input_ids"])
        params = SamplingParams(max_tokens=b.max_tokens or self.s.default_max_tokens, temperature=b.temperature,
                                top_p=b.top_p, seed=b.seed, stop_token_ids=b.stop_token_ids, ignore_eos=b.ignore_eos)
        t_inf = time.time()
        sent = [""]

        def on_tokens(_rid: str, so_far: list[int]) -> None:
            if job.deltas is not None:
                text = self.tokenizer.decode(so_far, skip_special_tokens=True)
                delta, sent[0] = text[len(sent[0]):], text
                if delta:
                    job.loop.call_soon_threadsafe(job.deltas.put_nowait, delta)

        t0 = time.monotonic()
        out = self.engine.generate([EngineRequest(f"{job.id}-0", ids, params)], on_tokens)[0]
        engine_s = time.monotonic() - t0
        t_post = time.time()
        burn_cpu(self.s.sim_postprocess_cpu_ms)
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        t_end = time.time()
        timings = {
            "preprocess": {"queue_wait_s": t_pre - job.created_at, "run_s": t_inf - t_pre},
            "inference": {"queue_wait_s": 0.0, "run_s": t_post - t_inf},
            "postprocess": {"queue_wait_s": 0.0, "run_s": t_end - t_post},
        }
        result = {"index": 0, "text": text, "token_ids": out.token_ids, "prompt_tokens": len(ids),
                  "completion_tokens": len(out.token_ids), "finish_reason": str(out.finish_reason.value),
                  "timings": timings, "batch_size": 1, "engine_time_s": engine_s}
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out.token_ids),
                 "total_tokens": len(ids) + len(out.token_ids)}
        return {"job_id": job.id, "status": "succeeded", "results": [result], "usage": usage}

    def view(self, job: Job) -> dict:
        v = {"id": job.id, "status": job.status, "created_at": job.created_at, "prompts": 1, "result": job.result}
        if job.error:
            v["error"] = {"type": "engine_error", "message": job.error}
        return v

    def shutdown(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=30)
        self.engine.shutdown()


async def _completion(srv: SerialServer, body: CompletionBody):
    """``POST /v1/completions``: one JSON answer, or server-sent events with ``stream``."""
    job = srv.submit(body, stream=body.stream)
    rid = f"cmpl-{job.id}"
    if not body.stream:
        await job.done.wait()
        if job.error:
            return JSONResponse({"error": {"message": job.error}}, status_code=500)
        res = job.result["results"][0]
        return {"id": rid, "object": "text_completion", "model": body.model,
                "choices": [{"index": 0, "text": res["text"], "finish_reason": res["finish_reason"]}],
                "usage": job.result["usage"]}

    def event(choices: list[dict], **extra) -> str:
        return f"data: {json.dumps({'id': rid, 'choices': choices, **extra})}\n\n"

    async def events():
        while (delta := await job.deltas.get()) is not None:
            yield event([{"index": 0, "text": delta}])
        await job.done.wait()
        if job.result:
            yield event([{"index": 0, "text": "", "finish_reason": job.result["results"][0]["finish_reason"]}])
            if (body.stream_options or {}).get("include_usage"):
                yield event([], usage=job.result["usage"])
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    state: dict[str, SerialServer] = {}

    async def lifespan(_app):
        state["server"] = await asyncio.to_thread(SerialServer, settings)
        yield
        await asyncio.to_thread(state["server"].shutdown)

    app = FastAPI(title="llmpipe serial baseline", lifespan=lifespan)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "engine": state["server"].engine.name}

    @app.post("/v1/jobs", status_code=202)
    async def create_job(body: JobBody):
        job = state["server"].submit(body)
        return {"id": job.id, "status": "queued", "status_url": f"/v1/jobs/{job.id}"}

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, wait: float = Query(0.0, ge=0.0, le=60.0)):
        srv = state["server"]
        job = srv.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        if wait > 0 and not job.done.is_set():
            try:
                await asyncio.wait_for(job.done.wait(), timeout=wait)
            except TimeoutError:
                pass
        return srv.view(job)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        return await _completion(state["server"], body)

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    uvicorn.run(create_app(), host=a.host, port=a.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
