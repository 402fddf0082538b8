"""Several inference workers of one model, side by side in one run (``llmpipe bench --modes
multiworker``, or ``python -m llmpipe.bench.multiworker``; docs/benchmarks.md).

* routing: real vLLM on the CPU (the shipped engine defaults, prefix caching on as vLLM has
  it), ``workers`` inference workers, ``prefixes`` distinct shared prefixes of about
  ``prefix_tokens`` tokens, each request one of them (at random) and a question of its own
  of about ``question_tokens``, streamed completions at ``concurrency``; once with
  prefix-aware routing and once with every request on the shared queue (prefix_routing
  off), each on a fresh stack. Per condition: TTFT p50 and p99, output tokens per second,
  each worker's prefix-cache hit rate (vLLM's counters, read from /metrics over the measured
  requests) and the route outcomes. Whether the prefixes fit one engine's KV cache decides
  how much routing can win; the report says how many prefix sets each cache holds.
* failover: ``llmpipe up --inference-workers N`` as a user runs it (the shipped defaults,
  supervised), ``jobs`` jobs in flight, ``kill -9`` of one worker's main process: the time
  from the kill to the last job done (its record's terminal write), on each broker given.

``run_multiworker`` is the entry point; it writes multiworker.json and multiworker.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from llmpipe.bench.loadgen import run_load
from llmpipe.bench.machine import run_meta
from llmpipe.bench.openai_client import OpenAIClient
from llmpipe.bench.prompts import make_prompts
from llmpipe.bench.stats import summarize
from llmpipe.engines.platform import engine_config
from llmpipe.local.pipeline import LocalPipeline
from llmpipe.local.redis_server import EmbeddedRedis, free_port
from llmpipe.local.up import child_env
from llmpipe.models.registry import resolve_model
from llmpipe.settings import Settings

log = logging.getLogger("llmpipe.bench")

# Bytes per KV cache element: vLLM keeps the cache in the model's dtype, float32 where the
# platform's default is float32 (a CPU without bf16: llmpipe/engines/platform.py), else 16 bits.
KV_BYTES = {"float32": 4}
KV_BYTES_DEFAULT = 2


@dataclass
class MultiOptions:
    model: str = "smollm2"
    workers: int = 2
    prefixes: int = 8
    prefix_tokens: int = 1024
    question_tokens: int = 64
    max_tokens: int = 32
    concurrency: int = 16
    requests: int = 240
    warmup: int = 16
    kv_cache_gib: float | None = None  # None: the setting's default
    failover_jobs: int = 40
    failover_max_tokens: int = 64
    brokers: tuple[str, ...] = ("redis", "rabbitmq")
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    parts: tuple[str, ...] = ("routing", "failover")
    request_timeout_s: float = 600.0
    extra: dict[str, Any] = field(default_factory=dict)  # further settings for every stack
    env: dict[str, str] = field(default_factory=dict)  # further environment for every stack (vLLM's variables)


def kv_tokens(model_path: str, gib: float, dtype: str | None = None) -> int | None:
    """About how many tokens a KV cache of ``gib`` holds for the model (from config.json) with
    the engine's ``dtype`` (16 bits when None or auto)."""
    try:
        c = json.loads((Path(model_path) / "config.json").read_text())
        head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        per_token = (2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head
                     * KV_BYTES.get(dtype or "", KV_BYTES_DEFAULT))
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None
    return int(gib * (1 << 30) // per_token)


def workload(tokenizer: Any, o: MultiOptions, n: int, seed: int = 0) -> list[str]:
    """``n`` prompts: one of ``o.prefixes`` shared prefixes (chosen at random) and a question."""
    prefixes = make_prompts(tokenizer, o.prefixes, o.prefix_tokens, seed=seed + 1)
    questions = make_prompts(tokenizer, n, o.question_tokens, seed=seed + 2)
    rng = random.Random(seed)
    return [f"{rng.choice(prefixes)}\n\nQuestion: {q}" for q in questions]


def scrape(api_url: str) -> dict[str, dict]:
    return parse_metrics(httpx.get(f"{api_url}/metrics", timeout=30).text)


def parse_metrics(text: str) -> dict[str, dict]:
    """/metrics: the prefix cache's queries and hits per worker, and the route outcomes."""
    out: dict[str, dict] = {"queries": {}, "hits": {}, "routes": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "llmpipe_engine_prefix_cache_queries_total":
                out["queries"][s.labels["worker"]] = out["queries"].get(s.labels["worker"], 0) + s.value
            elif s.name == "llmpipe_engine_prefix_cache_hits_total":
                out["hits"][s.labels["worker"]] = out["hits"].get(s.labels["worker"], 0) + s.value
            elif s.name == "llmpipe_route_requests_total":
                key = f"{s.labels['outcome']}/{s.labels['match']}"
                out["routes"][key] = out["routes"].get(key, 0) + s.value
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _stack(o: MultiOptions, model_path: str, state: Path, routing: bool) -> tuple[LocalPipeline, EmbeddedRedis]:
    server = EmbeddedRedis(state / "redis", appendonly=False).start()
    kw = {"kv_cache_gib": o.kv_cache_gib} if o.kv_cache_gib is not None else {}
    s = Settings(redis_url=server.url, model=model_path, state_dir=state, api_port=free_port(),
                 inference_workers=o.workers, prefix_routing=routing, **kw, **o.extra)
    lp = LocalPipeline(s, flower=False, extra_env={**child_env(s), **o.env}).start()
    try:
        lp.wait_ready(timeout=1800)
    except BaseException:
        lp.stop(timeout=30)
        server.stop()
        raise
    return lp, server


def routing_point(o: MultiOptions, model_path: str, prompts: list[str], out: Path, routing: bool,
                  console: Console) -> dict:
    """One condition: a fresh stack, the warm-up requests, then the measured ones."""
    name = "prefix-aware routing" if routing else "shared queue"
    console.print(f"[bold]{name}[/]: starting {o.workers} inference workers")
    lp, server = _stack(o, model_path, out / ("routed" if routing else "shared"), routing)
    try:
        client = OpenAIClient(lp.api_url, o.max_tokens, lp.s.served.default.id)
        console.print(f"{name}: {o.warmup} warm-up and {o.requests} measured requests at c={o.concurrency}")
        asyncio.run(run_load(client, prompts[:o.warmup], requests=o.warmup, concurrency=o.concurrency,
                             timeout_s=o.request_timeout_s))
        before = scrape(lp.api_url)
        samples = asyncio.run(run_load(client, prompts[o.warmup:], requests=o.requests, concurrency=o.concurrency,
                                       timeout_s=o.request_timeout_s))
        after = scrape(lp.api_url)
    finally:
        lp.stop(timeout=60)
        server.stop()
    queries, hits = _delta(after["queries"], before["queries"]), _delta(after["hits"], before["hits"])
    summary = summarize(samples, 0, o.concurrency)
    return {"condition": name, "routing": routing, "summary": summary,
            "hit_rate": {w: (hits.get(w, 0.0) / q if q else None) for w, q in sorted(queries.items())},
            "prompt_tokens": {w: q for w, q in sorted(queries.items())},
            "routes": _delta(after["routes"], before["routes"])}


def run_routing(o: MultiOptions, out: Path, console: Console) -> dict:
    from transformers import AutoTokenizer

    model_path = resolve_model(o.model, Settings().models_dir, progress=True)
    prompts = workload(AutoTokenizer.from_pretrained(model_path), o, o.warmup + o.requests)
    gib = o.kv_cache_gib if o.kv_cache_gib is not None else Settings().kv_cache_gib
    cap = kv_tokens(model_path, gib, engine_config(Settings()).args.get("dtype"))
    points = [routing_point(o, model_path, prompts, out, routing, console) for routing in (True, False)]
    routed, shared = (p["summary"] for p in points)
    ratio = {}
    if routed.get("ttft_s") and shared.get("ttft_s"):
        ratio["ttft_p50"] = routed["ttft_s"]["p50"] / shared["ttft_s"]["p50"]
        ratio["ttft_p99"] = routed["ttft_s"]["p99"] / shared["ttft_s"]["p99"]
    if shared.get("output_tok_s"):
        ratio["output_tok_s"] = routed["output_tok_s"] / shared["output_tok_s"]
    return {"points": points, "ratio_routed_to_shared": ratio, "kv_cache_gib": gib, "kv_cache_tokens": cap,
            "prefix_set_tokens": o.prefixes * o.prefix_tokens,
            "goals": {"ttft_p50": "<= 0.5x the shared queue's", "output_tok_s": ">= 1.0x"}}


def _amqp_ready(url: str) -> str | None:
    """None when RabbitMQ answers at ``url``, else why not."""
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=3) as c:
            c.ensure_connection(max_retries=1)
    except Exception as exc:  # the figure is skipped, with the reason
        log.warning("RabbitMQ at %s does not answer", url, exc_info=True)
        return f"{type(exc).__name__}: {exc}"
    return None


def run_failover(o: MultiOptions, out: Path, console: Console) -> list[dict]:
    from llmpipe.bench.failover import failover

    rows = []
    for broker in o.brokers:
        url = o.amqp_url if broker == "rabbitmq" else None
        why = _amqp_ready(url) if url else None
        if why:
            console.print(f"[yellow]failover on rabbitmq skipped: {why}[/]")
            rows.append({"broker": broker, "skipped": why})
            continue
        rows.append(failover(o, broker, url, out / f"failover-{broker}", console))
    return rows


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f}"


def _routing_md(o: dict, rt: dict) -> list[str]:
    cap = rt["kv_cache_tokens"]
    fits = f" (~{cap} tokens: {cap / rt['prefix_set_tokens']:.1f}x the prefix set)" if cap else ""
    lines = ["## Prefix-aware routing against the shared queue", "",
             (f"{o['prefixes']} shared prefixes of ~{o['prefix_tokens']} tokens, questions of ~{o['question_tokens']}, "
              f"{o['max_tokens']} output tokens, streamed completions at c={o['concurrency']}, "
              f"{o['requests']} measured requests after {o['warmup']}; each worker's KV cache "
              f"{rt['kv_cache_gib']:g} GiB{fits}; on {conditions(o)}."), "",
             "| condition | TTFT p50 ms | TTFT p99 ms | output tok/s | prefix-cache hit rate per worker | routes |",
             "|---|---|---|---|---|---|"]
    for p in rt["points"]:
        s, ttft = p["summary"], p["summary"].get("ttft_s") or {}
        hits = ", ".join(f"{w.split('@')[0]}: " + ("no requests" if h is None else f"{h:.2f}")
                         for w, h in p["hit_rate"].items())
        routes = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(p["routes"].items()) if v)
        lines.append(f"| {p['condition']} | {_ms(ttft.get('p50'))} | {_ms(ttft.get('p99'))} | "
                     f"{s['output_tok_s']:.1f} | {hits} | {routes or '-'} |")
    ratio = ", ".join(f"{k} {v:.2f}x" for k, v in rt["ratio_routed_to_shared"].items())
    goals = rt["goals"]
    return [*lines, "", (f"Routed / shared: {ratio} (goals: TTFT p50 {goals['ttft_p50']}, output tok/s "
                         f"{goals['output_tok_s']})."), ""]


def conditions(o: dict) -> str:
    """The settings and environment every stack ran with beyond the shipped defaults."""
    given = {**o["extra"], **o.get("env", {})}
    return "the shipped defaults" if not given else ", ".join(f"{k}={v}" for k, v in given.items())


def _failover_md(o: dict, rows: list[dict]) -> list[str]:
    on = conditions(o)
    lines = ["## Failover: kill -9 of one worker", "",
             (f"`llmpipe up --inference-workers {o['workers']}` on {on}, {o['failover_jobs']} jobs of "
              f"{o['failover_max_tokens']} tokens in flight, kill -9 of inference-1's main process."), "",
             "| broker | succeeded | held at the kill (per worker) | kill to last job done s | control, no kill s "
             "| added by the failover s |", "|---|---|---|---|---|---|"]
    for f in rows:
        if "skipped" in f:
            lines.append(f"| {f['broker']} | skipped: {f['skipped']} | | | | |")
        else:
            lines.append(f"| {f['broker']} | {f['succeeded']} of {f['jobs']} | {f['held_at_kill']} | "
                         f"{f['kill_to_last_done_s']:.2f} (goal <= {f['goal_s']:g}) | {f['control_last_done_s']:.2f} | "
                         f"{f['added_by_failover_s']:.2f} |")
    return lines


def markdown(result: dict) -> str:
    """multiworker.md: both figures with their conditions."""
    o, meta = result["options"], result["meta"]
    lines = ["# Several inference workers of one model", "",
             (f"Machine: {meta.get('machine', '')}; model {o['model']}; {o['workers']} inference workers; "
              f"command: `{meta.get('command', '')}`"), ""]
    if result.get("routing"):
        lines += _routing_md(o, result["routing"])
    if result.get("failover"):
        lines += _failover_md(o, result["failover"])
    return "\n".join(lines) + "\n"


def run_multiworker(o: MultiOptions, out: Path, console: Console) -> int:
    """Both figures (``o.parts``); writes multiworker.json and multiworker.md to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"meta": run_meta(), "options": asdict(o)}
    if "routing" in o.parts:
        result["routing"] = run_routing(o, out, console)
    if "failover" in o.parts:
        result["failover"] = run_failover(o, out, console)
    (out / "multiworker.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "multiworker.md").write_text(markdown(result))
    console.print(markdown(result))
    failed = [f for f in result.get("failover", []) if "skipped" not in f and f["succeeded"] != f["jobs"]]
    return 1 if failed else 0


def quick(o: MultiOptions) -> MultiOptions:
    """The smoke profile: the tiny model on float32 and eager, with vLLM's executor in its
    engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0: two processes import vLLM for an
    engine instead of three, and it starts in ~9 s here instead of ~20 s; the tiny model
    serves no slower so), a quarter-GiB KV cache unless one is given (32k tokens of the tiny
    model; vLLM zeroes the cache as it starts), a handful of requests, Redis only."""
    kv = o.kv_cache_gib if o.kv_cache_gib is not None else 0.25
    return MultiOptions(model="tiny", workers=o.workers, kv_cache_gib=kv, prefixes=2, prefix_tokens=256,
                        question_tokens=16, max_tokens=8, concurrency=2, requests=8, warmup=2, failover_jobs=8,
                        failover_max_tokens=16, brokers=("redis",), parts=o.parts, request_timeout_s=120.0,
                        extra={"dtype": "float32", "enforce_eager": True}, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


@click.command()
@click.option("--model", default="smollm2", show_default=True)
@click.option("--workers", type=int, default=2, show_default=True, help="Inference workers of the model.")
@click.option("--prefixes", type=int, default=8, show_default=True)
@click.option("--prefix-tokens", type=int, default=1024, show_default=True)
@click.option("--question-tokens", type=int, default=64, show_default=True)
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--concurrency", type=int, default=16, show_default=True)
@click.option("--requests", type=int, default=240, show_default=True, help="Measured requests per condition.")
@click.option("--kv-cache-gib", type=float, default=None, help="Each worker's KV cache (default: kv_cache_gib's).")
@click.option("--failover-jobs", type=int, default=40, show_default=True)
@click.option("--brokers", default="redis,rabbitmq", show_default=True, help="The failover figure's brokers.")
@click.option("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/", show_default=True)
@click.option("--parts", default="routing,failover", show_default=True)
@click.option("--quick", is_flag=True, help="Smoke profile: the tiny model, a handful of requests, Redis only.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results/multiworker"),
              show_default=True)
def main(out: Path, **kw) -> None:
    """Prefix-aware routing against the shared queue, and the failover after kill -9 of a worker."""
    kw["brokers"] = tuple(b.strip() for b in kw.pop("brokers").split(",") if b.strip())
    kw["parts"] = tuple(p.strip() for p in kw.pop("parts").split(",") if p.strip())
    is_quick = kw.pop("quick")
    o = MultiOptions(**kw)
    raise SystemExit(run_multiworker(quick(o) if is_quick else o, out, Console(stderr=True, highlight=False)))


if __name__ == "__main__":
    main()
