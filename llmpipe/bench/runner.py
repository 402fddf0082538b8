"""Runs the plan: for each engine, each mode's servers start, warm up, take every load point
(closed loop at a concurrency or open loop at a rate), and stop."""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from llmpipe.bench.cpu import CpuSampler, redis_delta, redis_snapshot, self_pid
from llmpipe.bench.gpu import GpuSampler
from llmpipe.bench.loadgen import JobsClient, OpenAIClient, enrich, run_load
from llmpipe.bench.modes import MODES, EngineSetup, Server, start_server
from llmpipe.bench.redis_trace import trace
from llmpipe.bench.stats import cdf_points, summarize
from llmpipe.broker.redis_clients import connect


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None
    rate: float | None = None
    requests: int = 0  # 0: as many as max_s allows
    max_s: float | None = None  # stop sending after this long

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate:g}/s"

    @property
    def warmup(self) -> int:
        """Requests left out of the latency figures: a closed loop's initial burst."""
        if self.concurrency is not None:
            return min(self.concurrency, self.requests // 2)
        return max(1, self.requests // 10)


@dataclass
class EnginePlan:
    setup: EngineSetup
    prompt_tokens: int
    max_tokens: int
    points: list[tuple[str, list[Load]]]  # (mode name, loads) in run order
    api: str = "jobs"  # client protocol of the serial and pipeline modes: jobs | openai
    prompts: list[str] = field(default_factory=list)
    measured_prompt_tokens: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class RunConfig:
    out: Path
    duration_s: float | None = None
    warm_requests: int = 2
    request_timeout_s: float = 300.0
    redis_trace: bool = True  # MONITOR a few idle requests on the noop pipelines
    seed: int = 0
    gpu: GpuSampler | None = None  # GPU utilization per load point (the GPU run)


def _client(server: Server, plan: EnginePlan, api: str):
    if server.mode.kind == "vllm-serve" or api == "openai":
        if "openai" not in server.protocols:
            raise RuntimeError(f"{server.mode.name} has no /v1/completions endpoint (try --api jobs)")
        return OpenAIClient(server.url, plan.max_tokens, plan.setup.model_path)
    return JobsClient(server.url, plan.max_tokens)


def run_plans(plans: list[EnginePlan], cfg: RunConfig, redis_url: str, console: Console) -> list[dict]:
    rows: list[dict] = []
    r = connect(redis_url)
    total_points = sum(len(loads) for p in plans for _, loads in p.points)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=False)
    with progress:
        overall = progress.add_task("bench", total=total_points)
        for plan in plans:
            for mode_name, loads in plan.points:
                mode = MODES[mode_name]
                tag = f"{plan.setup.key}/{mode_name}"
                step = progress.add_task(f"{tag}: starting", total=None)
                r.flushdb()
                t_start = time.monotonic()
                try:
                    server = start_server(mode, plan.setup, redis_url, cfg.out / "logs" / f"{plan.setup.key}-{mode_name}",
                                          console=console)
                except Exception as e:
                    console.print(f"[red]{tag}: could not start: {e}[/]")
                    for load in loads:
                        rows.append(_row(plan, mode_name, load, error=f"start failed: {e}"))
                        progress.advance(overall)
                    progress.remove_task(step)
                    continue
                startup_s = time.monotonic() - t_start
                try:
                    client = _client(server, plan, plan.api)
                    progress.update(step, description=f"{tag}: warm-up")
                    asyncio.run(run_load(client, plan.prompts[-cfg.warm_requests:], requests=cfg.warm_requests,
                                         concurrency=1, timeout_s=cfg.request_timeout_s))
                    base = 0
                    for load in loads:
                        progress.update(step, description=f"{tag} {load.label}", total=load.requests or None, completed=0)
                        load = Load(load.concurrency, load.rate, 0 if cfg.duration_s else load.requests, load.max_s)
                        row = _measure(plan, server, client, load, cfg, r, base, progress, step)
                        row["startup_s"] = startup_s
                        rows.append(row)
                        base += row["requests"]
                        progress.advance(overall)
                        lat = row["summary"]["latency_s"]["p50"]
                        console.print(f"{tag} {load.label}: {row['summary']['throughput_rps']:.2f} req/s, "
                                      f"p50 {lat * 1000 if lat else float('nan'):.0f} ms, errors {row['summary']['errors']}")
                    if plan.setup.key == "noop" and mode.kind in ("pipeline", "floor") and cfg.redis_trace:
                        progress.update(step, description=f"{tag}: Redis MONITOR trace")
                        rows[-len(loads)]["redis_trace"] = trace(redis_url, lambda: _sequential(client, plan, 10, cfg))
                    if plan.setup.key == "noop" and mode.kind == "pipeline" and "openai" in server.protocols:
                        progress.update(step, description=f"{tag}: stream ends")
                        rows[-len(loads)]["stream_end"] = stream_end_lag(server, plan, r, cfg)
                except Exception as e:
                    console.print(f"[red]{tag}: failed: {e}[/]")
                    console.print(traceback.format_exc(limit=3), markup=False)
                    done = {(x["engine"], x["mode"], x["load"]) for x in rows}
                    for load in loads:
                        if (plan.setup.key, mode_name, load.label) not in done:
                            rows.append(_row(plan, mode_name, load, error=str(e)))
                            progress.advance(overall)
                finally:
                    progress.update(step, description=f"{tag}: stopping")
                    t_stop = time.monotonic()
                    server.stop()
                    if rows and rows[-1]["mode"] == mode_name:
                        rows[-1]["stop_s"] = time.monotonic() - t_stop
                    progress.remove_task(step)
    r.close()
    return rows


def stream_end_lag(server: Server, plan: EnginePlan, r: redis.Redis, cfg: RunConfig, n: int = 20) -> dict:
    """How long after its job completed a stream ends: ``n`` streaming requests one at a
    time (POST /v1/completions), each from the job record's terminal write (``updated_at``)
    to the client's ``[DONE]``; both clocks are this machine's."""
    from llmpipe.bench.stats import percentile

    client = OpenAIClient(server.url, plan.max_tokens, plan.setup.model_path)
    samples = asyncio.run(run_load(client, plan.prompts[:n], requests=n, concurrency=1, timeout_s=cfg.request_timeout_s))
    lags = []
    for s in samples:
        job, done = s.extra.get("job_id"), s.extra.get("done_at")
        ended = r.hget(f"llmpipe:job:{job}", "updated_at") if s.ok and job and done else None
        if ended is not None:
            lags.append((done - float(ended)) * 1000)
    return {"n": len(lags), "p50_ms": percentile(lags, 50), "p90_ms": percentile(lags, 90), "max_ms": max(lags, default=None),
            "method": "client [DONE] (epoch) minus the job record's updated_at at its terminal move"}


def _sequential(client, plan: EnginePlan, n: int, cfg: RunConfig) -> int:
    samples = asyncio.run(run_load(client, plan.prompts[:n], requests=n, concurrency=1, timeout_s=cfg.request_timeout_s))
    return sum(s.ok for s in samples)


def _row(plan: EnginePlan, mode: str, load: Load, **kw) -> dict:
    return {"engine": plan.setup.key, "engine_label": plan.setup.label, "mode": mode, "load": load.label,
            "concurrency": load.concurrency, "rate": load.rate, **kw}


def _measure(plan: EnginePlan, server: Server, client, load: Load, cfg: RunConfig, r: redis.Redis, base: int,
             progress: Progress, step) -> dict:
    n = load.requests
    prompts = plan.prompts[base:] + plan.prompts[:base]  # fresh prompts for each point of a server
    groups = dict(server.groups)
    groups["loadgen"] = [self_pid()]
    rinfo = None
    if server.mode.kind in ("pipeline", "floor"):
        rinfo = redis_snapshot(r)
        pid = r.info("server").get("process_id")
        if pid:
            groups["redis"] = [int(pid)]
    sampler = CpuSampler(groups).start()
    t_begin = time.time()
    samples = asyncio.run(run_load(client, prompts, requests=n, concurrency=load.concurrency, rate=load.rate,
                                   duration_s=cfg.duration_s or load.max_s, seed=cfg.seed, timeout_s=cfg.request_timeout_s,
                                   on_done=lambda s: progress.advance(step)))
    cpu = sampler.stop()
    if client.protocol == "openai" and "jobs" in server.protocols:
        asyncio.run(enrich(server.url, samples))
    summary = summarize(samples, load.warmup, load.concurrency)
    row = _row(plan, server.mode.name, load, requests=len(samples), warmup=load.warmup, protocol=client.protocol,
               summary=summary, cpu=cpu, cdf=cdf_points(samples, load.warmup, load.concurrency),
               samples=[[x.i, round(x.start, 4), round(x.latency_s, 4), x.ok, x.ttft_s and round(x.ttft_s, 4),
                         x.completion_tokens, x.batch_size, x.engine_time_s and round(x.engine_time_s, 4)]
                        for x in samples])
    if rinfo is not None:
        row["redis"] = redis_delta(rinfo, redis_snapshot(r), len(samples))
    row["span"] = [t_begin, time.time()]
    if cfg.gpu is not None:
        # Over the same steady window as the rates and engine busy, and over the whole point.
        row["gpu"] = {"steady": cfg.gpu.summary(*summary["window"]), "point": cfg.gpu.summary(*row["span"])}
    return row
