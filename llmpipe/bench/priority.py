"""``llmpipe bench --modes priority``: does an interactive request overtake a batch backlog?

One pipeline on the SIMULATED GPU (llmpipe/engines/simulated.py), admission on its shipped
defaults. First ``batch_jobs`` batch-lane jobs (priority ``batch_priority``) are posted at
once; then interactive jobs (priority 0) arrive at ``interactive_rate`` per second, fixed
gaps, until the backlog has drained (or ``max_interactive``). Each job's end-to-end time is
the client's, from POST to the long-poll answer that it ended. The target: interactive p50
at most 0.15x the batch lane's p50, and every batch job finishes (no starvation).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from llmpipe.bench.burn import LOADER
from llmpipe.bench.loadgen import TERMINAL, ClientPool, JobsClient, Sample, _one, apply_view
from llmpipe.bench.modes import BASE_ENV, EngineSetup, Mode
from llmpipe.bench.prompts import count_tokens, make_prompts
from llmpipe.bench.stats import percentile
from llmpipe.jobs.lanes import batch_lane_slots
from llmpipe.local.pipeline import LocalPipeline
from llmpipe.local.redis_server import EmbeddedRedis
from llmpipe.settings import EngineKind, Settings

TARGET_RATIO = 0.15


@dataclass
class PriorityOptions:
    batch_jobs: int = 300
    interactive_rate: float = 1.0
    max_interactive: int = 200
    batch_priority: int = 10
    prompt_tokens: int = 512
    max_tokens: int = 64
    timeout_s: float = 900.0
    control: bool = False  # the "interactive" requests go in the batch lane too: no lanes


class LaneClient(JobsClient):
    def __init__(self, base_url: str, max_tokens: int, priority: int, timeout_s: float):
        super().__init__(base_url, max_tokens, job_timeout_s=timeout_s)
        self.priority = priority

    def body(self, prompt: str) -> dict:
        return {**super().body(prompt), "priority": self.priority}

    async def request(self, http: httpx.AsyncClient, s: Sample, prompt: str) -> None:
        """As JobsClient's, but a long poll that breaks (hundreds of them at once on a loaded
        machine) is polled again: the job is the same, only the reading failed."""
        r = await http.post(f"{self.base}/v1/jobs", json=self.body(prompt))
        if r.status_code != 202:
            s.error = f"POST {r.status_code}: {r.text[:200]}"
            return
        url = self.base + r.json()["status_url"]
        broken = 0
        while True:
            try:
                r = await http.get(url, params={"wait": 60})
            except httpx.TransportError:
                broken += 1
                if broken > 5:
                    raise
                continue
            if r.status_code != 200:
                s.error = f"GET {r.status_code}: {r.text[:200]}"
                return
            view = r.json()
            if view.get("status") in TERMINAL:
                break
        if view["status"] != "succeeded":
            s.error = f"job {view['status']}: {(view.get('error') or {}).get('message', '')[:200]}"
            return
        s.ok = True
        s.extra["broken_polls"] = broken
        apply_view(s, view)


async def drive(base_url: str, prompts: list[str], o: PriorityOptions, on_progress=None) -> dict:
    """The load and its figures (pure client; any server with the job API)."""
    batch = LaneClient(base_url, o.max_tokens, o.batch_priority, o.timeout_s)
    inter = LaneClient(base_url, o.max_tokens, o.batch_priority if o.control else 0, o.timeout_s)
    t0 = time.monotonic()

    async def one(lane: LaneClient, i: int, prompt: str) -> Sample:
        with clients.lent() as http:
            return await _one(lane, http, i, prompt, o.timeout_s)

    async with ClientPool() as clients:
        batch_tasks = [asyncio.create_task(one(batch, i, prompts[i % len(prompts)])) for i in range(o.batch_jobs)]
        inter_tasks: list[asyncio.Task] = []
        gap = 1.0 / o.interactive_rate
        nxt = time.monotonic()
        while len(inter_tasks) < o.max_interactive and not all(t.done() for t in batch_tasks):
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            i = len(inter_tasks)
            inter_tasks.append(asyncio.create_task(one(inter, i, prompts[(i + 7) % len(prompts)])))
            nxt += gap
            if on_progress is not None:
                on_progress(sum(t.done() for t in batch_tasks), len(inter_tasks))
        batch_s: list[Sample] = list(await asyncio.gather(*batch_tasks))
        inter_s: list[Sample] = list(await asyncio.gather(*inter_tasks))
    wall = time.monotonic() - t0
    return figures(batch_s, inter_s, wall)


def figures(batch: list[Sample], inter: list[Sample], wall_s: float) -> dict:
    def lane(samples: list[Sample]) -> dict:
        ok = [s.latency_s for s in samples if s.ok]
        # where the time went: each stage's median queue wait and run (the server's timings)
        stages = {}
        for st in ("preprocess", "inference", "postprocess"):
            for part in ("queue_wait_s", "run_s"):
                vals = [s.extra["timings"][st][part] for s in samples
                        if s.ok and (s.extra.get("timings") or {}).get(st)]
                stages[f"{st}.{part}"] = percentile(vals, 50)
        # the inference run split: the engine's part (its generate call), the rest is the batcher's
        stages["inference.engine_s"] = percentile([s.engine_time_s for s in samples
                                                   if s.ok and s.engine_time_s is not None], 50)
        return {"sent": len(samples), "ok": len(ok), "errors": sorted({s.error for s in samples if s.error})[:3],
                "p50_s": percentile(ok, 50), "p90_s": percentile(ok, 90), "p99_s": percentile(ok, 99),
                "max_s": max(ok) if ok else None, "stages_p50": stages}

    b, i = lane(batch), lane(inter)
    ratio = i["p50_s"] / b["p50_s"] if i["p50_s"] is not None and b["p50_s"] else None
    return {"batch": b, "interactive": i, "ratio_p50": ratio, "wall_s": wall_s,
            "met": ratio is not None and ratio <= TARGET_RATIO and b["ok"] == b["sent"] and i["ok"] == i["sent"]}


ENGINE_LINE = re.compile(r"simulated request=\S+ priority=(-?\d+) engine_wait_s=([\d.]+) engine_run_s=([\d.]+)")


def engine_split(log_text: str, batch_priority: int) -> dict:
    """Each lane's median wait for a running slot and time in the running set, inside the
    SIMULATED continuous engine (its per-request log lines)."""
    got: dict[str, tuple[list[float], list[float]]] = {"batch": ([], []), "interactive": ([], [])}
    for m in ENGINE_LINE.finditer(log_text):
        waits, runs = got["batch" if int(m.group(1)) >= batch_priority else "interactive"]
        waits.append(float(m.group(2)))
        runs.append(float(m.group(3)))
    return {lane: {"n": len(w), "wait_s": percentile(w, 50), "run_s": percentile(r, 50)}
            for lane, (w, r) in got.items() if w}


def engine_line(split: dict) -> str:
    return "Inside the SIMULATED GPU, median wait for a running slot / time running (s): " + "; ".join(
        f"{lane} {d['wait_s']:.2f} / {d['run_s']:.2f} ({d['n']} requests)" for lane, d in split.items()) + "."


def markdown(res: dict, o: PriorityOptions, conditions: str) -> str:
    def f(v):
        return "n/a" if v is None else f"{v:.2f}"

    rows = [f"| {name} | {d['sent']} | {d['ok']} | {f(d['p50_s'])} | {f(d['p90_s'])} | {f(d['p99_s'])} | {f(d['max_s'])} |"
            for name, d in ((f"batch (priority {o.batch_priority})", res["batch"]),
                            (f"interactive (priority {o.batch_priority if o.control else 0})", res["interactive"]))]
    return "\n".join([
        "| lane | jobs | finished | p50 e2e (s) | p90 (s) | p99 (s) | max (s) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        *(["Control run: the interactive requests were sent in the batch lane (no lanes).", ""] if o.control else []),
        "Median per stage, queue wait / run (s): " + "; ".join(
            f"{name}: " + ", ".join(f"{st} {f(d.get('stages_p50', {}).get(st + '.queue_wait_s'))}/"
                                    f"{f(d.get('stages_p50', {}).get(st + '.run_s'))}"
                                    for st in ("preprocess", "inference", "postprocess"))
            + f" (engine {f(d.get('stages_p50', {}).get('inference.engine_s'))})"
            for name, d in (("batch", res["batch"]), ("interactive", res["interactive"]))) + ".",
        "",
        *([engine_line(res["engine"]), ""] if res.get("engine") else []),
        f"Interactive p50 / batch p50: **{f(res['ratio_p50'])}** (target <= {TARGET_RATIO}); "
        f"{'met' if res['met'] else 'missed'}. Wall time {res['wall_s']:.0f} s.",
        "",
        conditions,
    ])


def _run(setup: EngineSetup, prompts: list[str], o: PriorityOptions, out: Path, console) -> tuple[dict, Settings]:
    """One pipeline, admission as shipped, the load of ``drive``; the engine's log split."""
    redis_srv = EmbeddedRedis(out / "redis", appendonly=False).start()
    try:
        s = setup.settings(Mode("priority", "pipeline", 0, True), redis_srv.url, out / "state")
        defaults = Settings()
        # Admission as shipped: the backlog must fit the batch lane's share of it.
        s = s.model_copy(update={"max_queue_depth": defaults.max_queue_depth,
                                 "max_queued_prompt_tokens": defaults.max_queued_prompt_tokens,
                                 "default_timeout_s": o.timeout_s, "max_timeout_s": o.timeout_s})
        env = dict(BASE_ENV)
        if setup.burns:
            env["CELERY_LOADER"] = LOADER
        p = LocalPipeline(s, flower=False, echo=False, console=console, extra_env=env, log_dir=out / "logs").start()
        try:
            p.wait_ready(timeout=300)
            console.print(f"priority bench: {o.batch_jobs} batch jobs, then interactive at {o.interactive_rate:g}/s")

            def progress(done: int, sent: int) -> None:
                if sent % 10 == 0:
                    console.print(f"  batch finished {done}/{o.batch_jobs}; interactive sent {sent}")

            res = asyncio.run(drive(p.api_url, prompts, o, progress))
        finally:
            p.stop(timeout=30)
        res["engine"] = engine_split("".join(f.read_text(errors="replace") for f in (out / "logs").glob("*.log")),
                                     o.batch_priority)
    finally:
        redis_srv.stop()
    return res, s


def _conditions(sim: dict, s: Settings, o: PriorityOptions, max_batch: int, cpu_workers: int, measured: float,
                load: tuple[float, float]) -> str:
    scheduled = (" scheduled step by step as vLLM v1 with scheduling_policy=priority and chunked prefill "
                 "(--sim-continuous; 2048 tokens per step; batch lane in at most "
                 f"{batch_lane_slots(s.lane_batch_slot_share, max_batch)} running slots)"
                 if sim.get("sim_continuous") else ", whole batches (no preemption)")
    return (
        f"Conditions: SIMULATED GPU{scheduled} (prefill {sim['sim_prefill_ms_per_token']} ms/token, step "
        f"{sim['sim_step_ms']} ms + {sim['sim_step_ms_per_seq']} ms per extra sequence; CPU burn "
        f"{sim.get('sim_preprocess_cpu_ms', 0):g} ms preprocess, {sim.get('sim_postprocess_cpu_ms', 0):g} ms "
        f"postprocess), max batch {max_batch}, window 0 ms, "
        f"{cpu_workers} processes per CPU pool; prompts ~{measured:.0f} tokens, max_tokens {o.max_tokens} "
        f"(ignore_eos); admission on the shipped defaults (max_queue_depth {s.max_queue_depth}, batch lane share "
        f"{s.lane_batch_share}); job API, client end-to-end (POST to the long-poll answer). Load average "
        f"{load[0]:.2f} at the start, {load[1]:.2f} at the end ({os.cpu_count()} CPUs, shared machine).")


def bench_priority(model_path: str, tokenizer, sim: dict, out: Path, console, *, max_batch: int = 32,
                   cpu_workers: int = 2, o: PriorityOptions | None = None) -> int:
    o = o or PriorityOptions()
    prompts = make_prompts(tokenizer, 64, o.prompt_tokens)
    measured = sum(count_tokens(tokenizer, p) for p in prompts[:20]) / 20
    setup = EngineSetup(key="simulated", kind=EngineKind.SIMULATED, label="SIMULATED GPU", model_path=model_path,
                        max_model_len=max(2048, o.prompt_tokens * 2 + o.max_tokens), max_batch=max_batch,
                        cpu_workers=cpu_workers, sim=dict(sim))
    out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    res, s = _run(setup, prompts, o, out, console)
    conditions = _conditions(sim, s, o, max_batch, cpu_workers, measured, (load_start, os.getloadavg()[0]))
    md = markdown(res, o, conditions)
    (out / "priority.md").write_text(md + "\n")
    (out / "priority.json").write_text(json.dumps({"options": o.__dict__, "result": res, "conditions": conditions},
                                                  indent=2, default=str))
    console.print(md)
    return 0 if res["met"] else 1
