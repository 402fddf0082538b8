"""``llmpipe bench --modes scaling``: what a second and a fourth inference worker buy, each
on its own host, with a 20 ms round trip between hosts; and what those hops add to the
latency of one worker against everything on one host.

Hosts are network namespaces (``llmpipe.testing.hosts``): Redis, the API, the CPU workers, each
inference worker and the load generator each on their own. The engine is the SIMULATED
GPU (it sleeps, so GPU time costs no CPU). Inference workers are started one after the
other on the same hosts (1, then 2, then 4), every other process stays up, and each
configuration takes every closed-loop concurrency. Then the same single worker runs on a
one-host layout (every role in one namespace, no proxy) for the network comparison.
Needs root and iproute2.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from llmpipe.bench.cpu import CpuSampler, self_pid
from llmpipe.bench.loadgen import JobsClient, run_load
from llmpipe.bench.machine import loadavg, run_meta
from llmpipe.bench.modes import BASE_ENV, MODES, EngineSetup
from llmpipe.bench.prompts import count_tokens, make_prompts
from llmpipe.bench.scaling_report import analyze, write
from llmpipe.bench.stats import cdf_points, summarize
from llmpipe.engines.simulated import SimulatedGpuCost
from llmpipe.models.registry import resolve_model
from llmpipe.settings import EngineKind, Settings
from llmpipe.testing.hosts.netns import available

# The default SIMULATED costs x 8: prefill 0.8 ms/token and a decode step of 36.8 ms + 1.2 ms
# per extra sequence (a GPU eight times slower per token, or a model that much larger). A
# batch of 8 of the default requests (512 + 64 tokens) "runs" ~6.2 s, so a worker serves
# ~1.3 req/s and four ~5.2 req/s. Every request still costs ~100 ms of CPU on this path (the
# pipeline, the proxies and the load generator; measured at four workers), so four workers
# need ~0.5 core: a quarter of the 2-core machine, leaving room for its other users. At x4
# four workers needed ~1.3 cores, and with other users taking half the machine the CPU side,
# not the GPU workers, capped 4 workers at c=128 (2.71x, half-full batches; that run is in
# git's history: docs/bench/scaling/diagnosis-x4-4workers-c128.md).
SIM_SCALE = 8.0
FULL = {"workers": [1, 2, 4], "concurrency": [64, 128], "network_concurrency": [1, 64], "prompt_tokens": 512,
        "max_tokens": 64, "max_batch": 8, "sim_scale": SIM_SCALE, "cpu_workers": 2, "cpu_instances": 4}
# 32 requests a point: routing's rendezvous order puts a given one of four workers first for
# a quarter of the (fresh) prompts, so it is the first choice of none with chance (3/4)^32 ~ 1e-4.
QUICK = {"workers": [1, 2, 4], "concurrency": [8], "network_concurrency": [1], "prompt_tokens": 32, "max_tokens": 8,
         "max_batch": 2, "sim_scale": 1.0, "requests": 32, "network_requests": 4, "cpu_workers": 2,
         "cpu_instances": 1}
WARMUP_PROMPTS = 2  # sent as each layout starts, from the end of the list


Point = tuple[int, int, bool]  # inference workers, concurrency, part of the network comparison


@dataclass
class ScalingOptions:
    out: Path
    model_path: str
    workers: list[int]
    concurrency: list[int]
    network_concurrency: list[int]
    prompt_tokens: int
    max_tokens: int
    max_batch: int
    cpu_workers: int
    sim: dict
    cpu_instances: int = 1
    hop_rtt_ms: float = 20.0
    requests: int | None = None  # per point; None: 4c + 16 (20 at c=1)
    network_requests: int | None = None
    duration_s: float | None = None
    request_timeout_s: float = 600.0
    quick: bool = False
    prompts: list[str] = field(default_factory=list)
    measured_prompt_tokens: float = 0.0
    sent_prompts: int = 0  # how many of ``prompts`` earlier points took

    def n_requests(self, c: int, network: bool = False) -> int:
        if network and self.network_requests:
            return self.network_requests
        if self.requests:
            return self.requests
        return 20 if c == 1 else 4 * c + 16

    def take_prompts(self, n: int) -> list[str]:
        """The prompts of a point of ``n`` requests: ones no earlier point sent. Prefix-aware
        routing remembers where each prompt went (route_prefix_ttl_s), so prompts sent again at
        four workers would go back to the two that served them at two, and the point would
        measure that memory, not four workers. A timed point (``n`` 0) takes them all, the
        unsent first."""
        start = self.sent_prompts
        if not n:
            return self.prompts[start:] + self.prompts[:start]
        if start + n > len(self.prompts) - WARMUP_PROMPTS:
            raise ValueError(f"{n} more prompts wanted, {len(self.prompts) - WARMUP_PROMPTS - start} unsent")
        self.sent_prompts += n
        return self.prompts[start:start + n]

    @property
    def cost(self) -> SimulatedGpuCost:
        return SimulatedGpuCost(self.sim["sim_prefill_ms_per_token"] / 1000, self.sim["sim_step_ms"] / 1000,
                                self.sim["sim_step_ms_per_seq"] / 1000, self.max_batch)

    def capacity_rps(self, workers: int) -> float:
        """Full batches back to back on every worker."""
        return workers * self.cost.theoretical_capacity_rps(round(self.measured_prompt_tokens), self.max_tokens,
                                                            self.max_batch)


def scaled_sim(defaults: Settings, scale: float, given: dict) -> dict:
    """The SIMULATED cost settings: ``scale`` x the defaults, unless given explicitly; no
    simulated CPU burn unless given (the question here is the GPU workers)."""
    sim = {k: getattr(defaults, k) * scale for k in ("sim_prefill_ms_per_token", "sim_step_ms", "sim_step_ms_per_seq")}
    sim.update(sim_preprocess_cpu_ms=0.0, sim_postprocess_cpu_ms=0.0)
    sim.update({k: v for k, v in given.items() if v is not None})
    return sim


def _setup(o: ScalingOptions) -> EngineSetup:
    return EngineSetup(key="simulated", kind=EngineKind.SIMULATED, label="SIMULATED GPU (cost model; sleeps, no GPU)",
                       model_path=o.model_path, max_model_len=-(-(o.prompt_tokens + o.max_tokens + 64) // 256) * 256,
                       max_batch=o.max_batch, cpu_workers=o.cpu_workers, sim=dict(o.sim))


class _Window:
    """Per-worker batch totals at the start and end of a closed loop's steady state: after
    the first ``warmup`` completions, and when the loop starts draining (``end``)."""

    def __init__(self, hp, warmup: int, end: int | None):
        self.hp, self.warmup, self.end = hp, warmup, end
        self.done = 0
        self.snaps: dict[str, dict] = {}
        self.lock = threading.Lock()

    def on_done(self, _sample) -> None:
        with self.lock:
            self.done += 1
            if self.done == self.warmup:
                self.snaps["start"] = self.hp.batch_totals()
            if self.end is not None and self.done == self.end:
                self.snaps["end"] = self.hp.batch_totals()

    def per_worker(self, before: dict, after: dict) -> dict:
        a, b = self.snaps.get("start", before), self.snaps.get("end", after)
        out = {}
        for w in b:
            reqs, batches = b[w][0] - a.get(w, (0, 0))[0], b[w][1] - a.get(w, (0, 0))[1]
            whole = (after[w][0] - before.get(w, (0, 0))[0], after[w][1] - before.get(w, (0, 0))[1])
            out[w] = {"steady_requests": reqs, "steady_batches": batches,
                      "mean_batch": reqs / batches if batches else None,
                      "requests": whole[0], "batches": whole[1]}
        return out


def measure(hp, o: ScalingOptions, layout: str, workers: int, c: int, network: bool, console: Console) -> dict:
    n = 0 if o.duration_s else o.n_requests(c, network)
    warmup = min(c, n // 2) if n else c
    before = hp.batch_totals()
    window = _Window(hp, warmup, n - c if n and n - c > warmup else None)
    sampler = CpuSampler({**hp.cpu_groups(), "loadgen": [self_pid()]}).start()
    client = JobsClient(hp.api_url, o.max_tokens, job_timeout_s=o.request_timeout_s)
    samples = hp.hosts.call(hp.placement.client, asyncio.run, run_load(
        client, o.take_prompts(n), requests=n, concurrency=c, duration_s=o.duration_s, timeout_s=o.request_timeout_s,
        on_done=window.on_done))
    cpu = sampler.stop()
    summary = summarize(samples, warmup, c)
    row = {"layout": layout, "workers": workers, "concurrency": c, "requests": len(samples), "summary": summary,
           "cpu": cpu, "per_worker": window.per_worker(before, hp.batch_totals()),
           "latencies_s": cdf_points(samples, warmup, c), "capacity_rps": o.capacity_rps(workers)}
    lat = summary["latency_s"]
    console.print(f"{layout} workers={workers} c={c}: {summary['throughput_rps']:.2f} req/s, p50 "
                  f"{(lat['p50'] or 0) * 1000:.0f} ms, p99 {(lat['p99'] or 0) * 1000:.0f} ms, errors {summary['errors']}, "
                  "mean batch per worker " + ", ".join(
                      f"{w}: {v['mean_batch']:.1f}" if v["mean_batch"] else f"{w}: n/a" for w, v in row["per_worker"].items()))
    return row


def _run_layout(o: ScalingOptions, layout: str, console: Console, points: list[Point]) -> list[dict]:
    """Start the layout, take ``points`` (workers, concurrency, network?) in order, stop."""
    from llmpipe.testing.hosts.harness import Hosts
    from llmpipe.testing.hosts.pipeline import HostsPipeline, Placement

    max_workers = max(w for w, _, _ in points)
    one = layout == "one-host"
    placement = Placement.one_host(max_workers) if one else Placement.spread(max_workers)
    base = o.out / layout
    settings = _setup(o).settings(MODES["pipeline-window50"], "redis://unused:1/0", base / "state")
    rows = []
    with Hosts(base / "logs", one_way_delay_ms=0 if one else o.hop_rtt_ms / 2, console=console) as hosts:
        hp = HostsPipeline(settings, hosts, placement, extra_env=dict(BASE_ENV), cpu_instances=o.cpu_instances)
        t0 = time.monotonic()
        with console.status(f"{layout}: starting {len(placement.names)} host(s)"):
            hp.start(points[0][0])
            hp.wait_ready()
            # Connections and first-use costs out of the way before anything is measured.
            client = JobsClient(hp.api_url, o.max_tokens, job_timeout_s=o.request_timeout_s)
            hosts.call(placement.client, asyncio.run, run_load(client, o.prompts[-WARMUP_PROMPTS:],
                                                               requests=WARMUP_PROMPTS, concurrency=1,
                                                               timeout_s=o.request_timeout_s))
        console.print(f"{layout}: {len(placement.names)} host(s) up in {time.monotonic() - t0:.0f} s; logs in {base / 'logs'}")
        for workers, c, network in points:
            if workers > len(hp.inference):
                hp.scale_inference(workers)
                hp.wait_ready()
            try:
                rows.append(measure(hp, o, layout, workers, c, network, console))
            except Exception as e:  # one failed point must not lose the others
                console.print(f"[red]{layout} workers={workers} c={c}: failed: {e}[/]")
                rows.append({"layout": layout, "workers": workers, "concurrency": c, "error": str(e)})
        hosts.stop_children(timeout=30)
    return rows


def plan(o: ScalingOptions) -> list[tuple[str, list[Point]]]:
    """Each layout and its points, in the order they run."""
    workers = sorted(set(o.workers))
    spread = [(w, c, False) for w in workers for c in o.concurrency]
    # The network comparison uses one worker; points the scaling run has already taken
    # at one worker serve both.
    if 1 in workers:
        spread[len(o.concurrency):len(o.concurrency)] = [(1, c, True) for c in o.network_concurrency
                                                           if c not in o.concurrency]
    else:
        spread = [(1, c, True) for c in o.network_concurrency] + spread
    return [(f"hosts-{o.hop_rtt_ms:g}ms", spread), ("one-host", [(1, c, True) for c in o.network_concurrency])]


def prompts_needed(o: ScalingOptions) -> int:
    """Prompts for every point of the plan, each its own, and the warm-up's."""
    return sum(o.n_requests(c, network) for _, points in plan(o) for _, c, network in points) + WARMUP_PROMPTS


def run_scaling(o: ScalingOptions, console: Console) -> list[dict]:
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the hosts are torn down; a
    # second one (timeout(1) forwards its own) must not cut that tear-down short.
    def on_sigterm(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    return [row for layout, points in plan(o) for row in _run_layout(o, layout, console, points)]


def conditions_text(o: ScalingOptions) -> str:
    one = o.cost.batch_s([round(o.measured_prompt_tokens)], [o.max_tokens])
    full = o.cost.batch_s([round(o.measured_prompt_tokens)] * o.max_batch, [o.max_tokens] * o.max_batch)
    return (f"SIMULATED GPU engine (sleeps; no GPU): prefill {o.sim['sim_prefill_ms_per_token']:g} ms/token, decode step "
            f"{o.sim['sim_step_ms']:g} ms + {o.sim['sim_step_ms_per_seq']:g} ms per extra sequence; prompts "
            f"~{o.measured_prompt_tokens:.0f} tokens (measured), max_tokens {o.max_tokens} with ignore_eos; one request "
            f"alone = {one * 1000:.0f} ms, a full batch of {o.max_batch} = {full * 1000:.0f} ms of simulated GPU time, "
            f"so one worker's capacity is {o.capacity_rps(1):.2f} req/s. Batching window 50 ms, max batch "
            f"{o.max_batch}; {o.cpu_instances} Celery worker(s) per CPU stage, each a pool of {o.cpu_workers} "
            f"processes; simulated CPU burn "
            f"{o.sim['sim_preprocess_cpu_ms']:g} / {o.sim['sim_postprocess_cpu_ms']:g} ms (pre / post). Hosts: network "
            f"namespaces on one bridge; Redis, the API, the CPU workers (preprocess + postprocess/collect), each "
            f"inference worker and the load generator on their own; every path between two hosts (API->Redis, "
            f"workers->Redis, client->API) goes through a TCP proxy that adds {o.hop_rtt_ms / 2:g} ms each way "
            f"({o.hop_rtt_ms:g} ms per round trip). One host: every role in one namespace, no proxy. Closed loop, job "
            f"API (POST /v1/jobs, GET ?wait=60), each point with prompts no earlier point sent; throughput = "
            f"concurrency / mean latency of the steady requests; per-worker mean batch from each worker's "
            f"llmpipe_batch_size_requests histogram over the steady window.")


def _options(given: dict, quick: bool, model_path: str, tokenizer) -> ScalingOptions:
    prof = dict(FULL, **(QUICK if quick else {}))
    o = ScalingOptions(
        out=Path(given.get("out") or "bench-results"), model_path=model_path,
        workers=given.get("workers") or prof["workers"], concurrency=given.get("concurrency") or prof["concurrency"],
        network_concurrency=prof["network_concurrency"], prompt_tokens=given.get("prompt_tokens") or prof["prompt_tokens"],
        max_tokens=given.get("max_tokens") or prof["max_tokens"], max_batch=given.get("max_batch_size") or prof["max_batch"],
        cpu_workers=given.get("cpu_workers") or prof["cpu_workers"],
        cpu_instances=given.get("cpu_instances") or prof["cpu_instances"],
        sim=scaled_sim(Settings(), prof["sim_scale"], {k: given.get(k) for k in (
            "sim_prefill_ms_per_token", "sim_step_ms", "sim_step_ms_per_seq", "sim_preprocess_cpu_ms",
            "sim_postprocess_cpu_ms")}),
        hop_rtt_ms=given.get("hop_rtt_ms") or 20.0, requests=given.get("requests") or prof.get("requests"),
        network_requests=prof.get("network_requests"), duration_s=given.get("duration"),
        request_timeout_s=given.get("request_timeout") or 600.0, quick=quick)
    o.prompts = make_prompts(tokenizer, prompts_needed(o), o.prompt_tokens)
    o.measured_prompt_tokens = sum(count_tokens(tokenizer, p) for p in o.prompts[:20]) / min(20, len(o.prompts))
    return o


def bench_scaling(given: dict, console: Console) -> int:
    """The ``--modes scaling`` run. ``given``: the bench options the user set explicitly."""
    from transformers import AutoTokenizer

    why = available()
    if why:
        console.print(f"[red]the scaling mode runs hosts as network namespaces: {why}[/]")
        return 2
    quick = bool(given.get("quick"))
    model = given.get("model") or ("tiny" if quick else "smollm2")
    with console.status(f"preparing model {model}"):
        model_path = str(resolve_model(model, Settings().models_dir, progress=False))
        o = _options(given, quick, model_path, AutoTokenizer.from_pretrained(model_path))
    meta = {**run_meta(), "profile": "quick (smoke; targets not evaluated)" if quick else "default"}
    console.print(conditions_text(o))
    t0 = time.monotonic()
    rows = run_scaling(o, console)
    meta.update(duration_s=time.monotonic() - t0, loadavg_end=loadavg())
    hops = f"hosts-{o.hop_rtt_ms:g}ms"
    result = {"meta": meta, "conditions": conditions_text(o), "rows": rows,
              "options": {"workers": o.workers, "concurrency": o.concurrency, "network_concurrency": o.network_concurrency,
                          "prompt_tokens": o.prompt_tokens, "max_tokens": o.max_tokens, "max_batch": o.max_batch,
                          "cpu_workers": o.cpu_workers, "cpu_instances": o.cpu_instances, "sim": o.sim,
                          "hop_rtt_ms": o.hop_rtt_ms, "model": model_path},
              "analysis": analyze(rows, hops, o.max_batch, o.concurrency, o.network_concurrency, quick)}
    files = write(result, o.out)
    for t in result["analysis"]["targets"]:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        console.print(f"{'[green]met[/]' if t['met'] else '[red]missed[/]'} {t['name']}: {v} (want {t['target']}; "
                      f"{t['detail']})")
    console.print(f"wrote {', '.join(str(f) for f in files)} in {meta['duration_s']:.0f} s")
    return 1 if any("error" in r for r in rows) else 0
