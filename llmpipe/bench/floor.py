"""The ``celery-floor`` mode: what Celery alone costs for the pipeline's shape of work.

Three bare Celery tasks that do no work (each returns its argument) on the queues and with
the settings of the pipeline's stages: the same pools and concurrency (``workers/launch.py``),
``acks_late``, ``reject_on_worker_lost``, prefetch, JSON, visibility timeout and task-event
setting (``celeryconfig.py``), on the same Redis as broker and result backend. In front of
them, a minimal HTTP endpoint on the same HTTP stack as the pipeline's API (FastAPI under
uvicorn): ``POST /v1/jobs`` sends the chain ``preprocess | inference | postprocess``, and
``GET /v1/jobs/{id}?wait=`` waits for its result with Celery's own ``AsyncResult.get``. It
speaks just enough of the job API for the benchmark's load generator to drive it like the
pipeline. There is no llmpipe bookkeeping: no job record, admission, idempotency memo,
cancel flag, deadline, token stream or chord.

Workers: ``celery -A llmpipe.bench.floor worker -Q preprocess ...`` (``floor_worker_argv``).
API: ``python -m llmpipe.bench.floor --port N``.
"""

from __future__ import annotations

import sys
import time

from celery import Celery, chain
from celery.backends.redis import RedisBackend
from kombu import Queue

QUEUES = ("preprocess", "inference", "postprocess")
MODULE = "llmpipe.bench.floor"  # also when run as __main__

app = Celery("llmpipe-floor")
app.config_from_object("celeryconfig")  # the pipeline's reliability, serializer and event settings
app.conf.update(
    imports=(),  # none of llmpipe's tasks or worker signals (readiness, watchdog, engine warm-up)
    task_queues=tuple(Queue(q) for q in QUEUES),
    task_routes={f"floor.{q}": {"queue": q} for q in QUEUES},
    task_default_queue="preprocess",
)


# As in the pipeline, only the last task of the chain stores a result.
@app.task(name="floor.preprocess", ignore_result=True)
def preprocess(msg: dict) -> dict:
    return msg


@app.task(name="floor.inference", ignore_result=True)
def inference(msg: dict) -> dict:
    return msg


@app.task(name="floor.postprocess")
def postprocess(msg: dict) -> dict:
    return msg


class WaitingRedisBackend(RedisBackend):
    """Celery's Redis backend, except that sending a task does not subscribe to its result
    channel: here the first task of each chain is sent, whose result is never stored, and
    Celery would keep one subscription per request for good. ``AsyncResult.get`` on the
    chain's last task subscribes (and unsubscribes) as usual."""

    def on_task_call(self, producer, task_id):
        pass


def floor_worker_argv(kind: str, s, *, name: str) -> list[str]:
    """The pipeline worker's command line (pool, concurrency, prefetch, events) on the floor's app."""
    from workers.launch import worker_argv

    argv = worker_argv(kind, s, name=name)
    argv[argv.index("tasks")] = "llmpipe.bench.floor"
    q = argv.index("-Q") + 1
    argv[q] = kind  # the pipeline's postprocess worker also serves its chord callback queue
    return argv


def create_app():
    import anyio
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app.conf.update(result_backend=f"{MODULE}:WaitingRedisBackend+{app.conf.broker_url}")

    async def lifespan(_):
        # Each waiting GET holds a thread (AsyncResult.get blocks); 64 clients need 64 of them.
        anyio.to_thread.current_default_thread_limiter().total_tokens = 512
        yield

    api = FastAPI(title="llmpipe celery floor", lifespan=lifespan)
    created: dict[str, float] = {}

    @api.post("/v1/jobs", status_code=202)
    def submit(body: dict):
        res = chain(preprocess.s(body), inference.s(), postprocess.s()).apply_async()
        created[res.id] = time.time()
        return {"id": res.id, "status": "queued", "status_url": f"/v1/jobs/{res.id}"}

    @api.get("/v1/jobs/{job_id}")
    def get_job(job_id: str, wait: float = 0.0):
        res = app.AsyncResult(job_id)
        try:
            value = res.get(timeout=wait, propagate=False) if wait > 0 else (res.result if res.ready() else None)
        except TimeoutError:
            value = None
        if not res.ready():
            return JSONResponse({"id": job_id, "status": "running"})
        ok = res.successful()
        out = {"id": job_id, "status": "succeeded" if ok else "failed", "created_at": created.pop(job_id, None)}
        if ok:
            out["result"] = {"results": [{"completion_tokens": int(value.get("max_tokens", 0)), "engine_time_s": 0.0,
                                          "batch_size": 1, "timings": {}}]}
        return out

    @api.get("/healthz")
    def healthz():
        return {"status": "ok"}

    return api


def main(argv: list[str] | None = None) -> None:
    import argparse

    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    # As the pipeline's API (llmpipe/cli/commands.py api): access log on, info level.
    uvicorn.run(f"{MODULE}:create_app", factory=True, host=a.host, port=a.port, log_level="info",
                timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main(sys.argv[1:])
