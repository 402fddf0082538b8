"""Runs the plan: for each engine, each mode's servers start, warm up, take every load point
(closed loop at a concurrency or open loop at a rate), and stop. An interleaved plan (the real
engine's) starts every mode's server first and has them take each point in turn, so that a
machine whose speed drifts during the run moves every mode's figure of a point alike."""

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
from llmpipe.bench.kinds import JOBS, endpoint
from llmpipe.bench.loadgen import JobsClient, enrich, run_load
from llmpipe.bench.modes import ENDPOINTS, MODES, EngineSetup, Mode, Server, start_server
from llmpipe.bench.openai_client import OpenAIClient
from llmpipe.bench.redis_trace import trace
from llmpipe.bench.stats import cdf_points, percentile, summarize
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
    kinds: list[str] = field(default_factory=lambda: ["completions-stream"])  # OpenAI request kinds (kinds.py)
    interleave: bool = False  # every mode's server up at once, taking each point in turn

    def kinds_for(self, mode: Mode) -> list[str]:
        """The request kinds ``mode``'s server takes, in order: the job API where the plan
        drives it (vllm serve has none), else each of ``kinds`` its server answers; a server
        that answers none of them (the celery floor) takes the job API."""
        have = ENDPOINTS[mode.kind]
        if self.api == JOBS and JOBS in have:
            return [JOBS]
        return [k for k in self.kinds if endpoint(k) in have] or ([JOBS] if JOBS in have else [])


@dataclass
class RunConfig:
    out: Path
    duration_s: float | None = None
    warm_requests: int = 2
    request_timeout_s: float = 300.0
    redis_trace: bool = True  # MONITOR a few idle requests on the noop pipelines
    seed: int = 0
    gpu: GpuSampler | None = None  # GPU utilization per load point (the GPU run)


def client_for(server: Server, plan: EnginePlan, kind: str):
    if kind == JOBS:
        return JobsClient(server.url, plan.max_tokens)
    return OpenAIClient.of_kind(kind, server.url, plan.max_tokens, plan.setup.model_path)


def run_plans(plans: list[EnginePlan], cfg: RunConfig, redis_url: str, console: Console) -> list[dict]:
    rows: list[dict] = []
    r = connect(redis_url)
    total_points = sum(len(loads) * len(p.kinds_for(MODES[m])) for p in plans for m, loads in p.points)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=False)
    with progress:
        run = _ModeRun(cfg, redis_url, r, console, progress, progress.add_task("bench", total=total_points), rows)
        for plan in plans:
            if plan.interleave and len(plan.points) > 1:
                run.interleaved(plan)
                continue
            for mode_name, loads in plan.points:
                run.mode(plan, MODES[mode_name], loads)
    r.close()
    return rows


@dataclass
class _ModeRun:
    """One mode of one engine: its server starts, warms up, takes every kind at every load, stops."""

    cfg: RunConfig
    redis_url: str
    r: redis.Redis
    console: Console
    progress: Progress
    overall: object
    rows: list[dict]

    def mode(self, plan: EnginePlan, mode: Mode, loads: list[Load]) -> None:
        tag = f"{plan.setup.key}/{mode.name}"
        kinds = plan.kinds_for(mode)
        step = self.progress.add_task(f"{tag}: starting", total=None)
        self.r.flushdb()
        started = self._start(plan, mode, loads, kinds)
        if started is None:
            self.progress.remove_task(step)
            return
        server, startup_s = started
        try:
            self._measure_all(plan, server, loads, kinds, step, startup_s)
        except Exception as e:
            self.console.print(f"[red]{tag}: failed: {e}[/]")
            self.console.print(traceback.format_exc(limit=3), markup=False)
            self._failed(plan, mode, loads, kinds, str(e))
        finally:
            self.progress.update(step, description=f"{tag}: stopping")
            self._stop(plan, server)
            self.progress.remove_task(step)

    def _start(self, plan: EnginePlan, mode: Mode, loads: list[Load], kinds: list[str]) -> tuple[Server, float] | None:
        """The mode's server and its start-up seconds; None (its points failed) when it cannot start."""
        t_start = time.monotonic()
        try:
            server = start_server(mode, plan.setup, self.redis_url,
                                  self.cfg.out / "logs" / f"{plan.setup.key}-{mode.name}", console=self.console)
        except Exception as e:
            self.console.print(f"[red]{plan.setup.key}/{mode.name}: could not start: {e}[/]")
            self._failed(plan, mode, loads, kinds, f"start failed: {e}")
            return None
        return server, time.monotonic() - t_start

    def _stop(self, plan: EnginePlan, server: Server) -> None:
        """Stops the server; its stop seconds go on its last measured row, else on its last
        failed one (a server whose every point failed still says how long it took to stop)."""
        t_stop = time.monotonic()
        server.stop()
        mine = [x for x in self.rows if x["engine"] == plan.setup.key and x["mode"] == server.mode.name]
        last = [x for x in mine if "error" not in x] or mine
        if last:
            last[-1]["stop_s"] = time.monotonic() - t_stop

    def interleaved(self, plan: EnginePlan) -> None:
        """Every mode's server up, then each (kind, load) point taken by each mode in turn."""
        step = self.progress.add_task(f"{plan.setup.key}: starting", total=None)
        self.r.flushdb()
        up: list[tuple[Mode, list[Load], Server, float]] = []
        try:
            for name, loads in plan.points:
                mode = MODES[name]
                self.progress.update(step, description=f"{plan.setup.key}/{name}: starting")
                started = self._start(plan, mode, loads, plan.kinds_for(mode))
                if started is not None:
                    up.append((mode, loads, *started))
            self._take_turns(plan, up, step)
        finally:
            for _, _, server, _ in up:
                self._stop(plan, server)
            self.progress.remove_task(step)
        order = {name: i for i, (name, _) in enumerate(plan.points)}
        mine = sorted((x for x in self.rows if x["engine"] == plan.setup.key), key=lambda x: order[x["mode"]])
        self.rows[:] = [x for x in self.rows if x["engine"] != plan.setup.key] + mine  # mode by mode, as run alone

    def _take_turns(self, plan: EnginePlan, up: list, step) -> None:
        """A server that fails a point takes no more turns: its points left fail with its error."""
        base = {mode.name: 0 for mode, *_ in up}
        warmed: set[tuple[str, str]] = set()
        broken: dict[str, str] = {}
        for kind in dict.fromkeys(k for mode, *_ in up for k in plan.kinds_for(mode)):
            for i in range(max(len(loads) for _, loads, *_ in up)):
                for mode, loads, server, startup_s in up:
                    if kind not in plan.kinds_for(mode) or i >= len(loads) or mode.name in broken:
                        continue
                    try:
                        client = client_for(server, plan, kind)
                        self._warm(server, client, plan, kind, warmed)
                        base[mode.name] += self._point(plan, server, client, loads[i], base[mode.name], step,
                                                       startup_s)["requests"]
                    except Exception as e:
                        self.console.print(f"[red]{plan.setup.key}/{mode.name} {kind} {loads[i].label}: failed: {e}[/]")
                        broken[mode.name] = str(e)
        for mode, loads, *_ in up:
            if mode.name in broken:
                self._failed(plan, mode, loads, plan.kinds_for(mode), broken[mode.name])

    def _failed(self, plan: EnginePlan, mode: Mode, loads: list[Load], kinds: list[str], error: str) -> None:
        done = {(x["engine"], x["mode"], x.get("kind"), x["load"]) for x in self.rows}
        for kind in kinds:
            for load in loads:
                if (plan.setup.key, mode.name, kind, load.label) not in done:
                    self.rows.append(_row(plan, mode.name, load, kind=kind, error=error))
                    self.progress.advance(self.overall)

    def _measure_all(self, plan: EnginePlan, server: Server, loads: list[Load], kinds: list[str], step,
                     startup_s: float) -> None:
        first = len(self.rows)
        base = 0
        warmed: set[tuple[str, str]] = set()
        for kind in kinds:
            client = client_for(server, plan, kind)
            self._warm(server, client, plan, kind, warmed)
            for load in loads:
                base += self._point(plan, server, client, load, base, step, startup_s)["requests"]
        if kinds:
            self._extras(plan, server, client, self.rows[first])

    def _warm(self, server: Server, client, plan: EnginePlan, kind: str, warmed: set[tuple[str, str]]) -> None:
        """The server's first requests, then one for each further kind (its endpoint's first use)."""
        first = not any(m == server.mode.name for m, _ in warmed)
        if (server.mode.name, kind) in warmed:
            return
        warmed.add((server.mode.name, kind))
        warm = self.cfg.warm_requests if first else 1
        asyncio.run(run_load(client, plan.prompts[-warm:], requests=warm, concurrency=1,
                             timeout_s=self.cfg.request_timeout_s))

    def _point(self, plan: EnginePlan, server: Server, client, load: Load, base: int, step, startup_s: float) -> dict:
        """One load point of one server: measured, kept as a row, said on the console."""
        cfg, tag, kind = self.cfg, f"{plan.setup.key}/{server.mode.name}", getattr(client, "kind", JOBS)
        self.progress.update(step, description=f"{tag} {kind} {load.label}", total=load.requests or None, completed=0)
        load = Load(load.concurrency, load.rate, 0 if cfg.duration_s else load.requests, load.max_s)
        row = _measure(plan, server, client, load, cfg, self.r, base, self.progress, step)
        row["startup_s"] = startup_s
        self.rows.append(row)
        self.progress.advance(self.overall)
        s = row["summary"]
        lat, ttft = s["latency_s"]["p50"], (s["ttft_s"] or {}).get("p50")
        self.console.print(f"{tag} {kind} {load.label}: {s['throughput_rps']:.2f} req/s, {s['output_tok_s']:.0f} "
                           f"tok/s, p50 {lat * 1000 if lat else float('nan'):.0f} ms"
                           + (f", TTFT p50 {ttft * 1000:.0f} ms" if ttft else "") + f", errors {s['errors']}")
        return row

    def _extras(self, plan: EnginePlan, server: Server, client, first_row: dict) -> None:
        """The no-op pipelines' Redis MONITOR trace and stream-end lag, on the mode's first row."""
        if plan.setup.key != "noop" or server.mode.kind not in ("pipeline", "floor"):
            return
        if self.cfg.redis_trace:
            first_row["redis_trace"] = trace(self.redis_url, lambda: _sequential(client, plan, 10, self.cfg))
        if server.mode.kind == "pipeline":
            first_row["stream_end"] = stream_end_lag(server, plan, self.r, self.cfg)


def stream_end_lag(server: Server, plan: EnginePlan, r: redis.Redis, cfg: RunConfig, n: int = 20) -> dict:
    """How long after its job completed a stream ends: ``n`` streaming requests one at a
    time (POST /v1/completions), each from the job record's terminal write (``updated_at``)
    to the client's ``[DONE]``; both clocks are this machine's."""
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
    if client.protocol == "openai" and JOBS in server.protocols:
        asyncio.run(enrich(server.url, samples))
    summary = summarize(samples, load.warmup, load.concurrency)
    row = _row(plan, server.mode.name, load, kind=getattr(client, "kind", JOBS), requests=len(samples),
               warmup=load.warmup, protocol=client.protocol,
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
