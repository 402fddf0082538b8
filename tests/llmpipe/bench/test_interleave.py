"""The real engine's modes take turns at each point (llmpipe/bench/runner.py): every server
starts first, each (kind, load) point is measured by each mode in turn, the rows come out
mode by mode as a sequential run writes them, and a server that cannot start fails only its
own points. Servers and measurements are stand-ins: what is tested is the order."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from llmpipe.bench import runner
from llmpipe.bench.modes import MODES, EngineSetup, Server
from llmpipe.bench.plan import interleaves
from llmpipe.bench.runner import EnginePlan, Load, RunConfig, _ModeRun
from llmpipe.engines.platform import Platform
from llmpipe.engines.vllm_batch_defaults import Device
from llmpipe.settings import EngineKind

MODE_NAMES = ["pipeline-window50", "vllm-serve"]
EARLIER = {"engine": "noop", "mode": "serial", "kind": "jobs", "load": "c=1"}
LOADS = [Load(concurrency=1, requests=2), Load(concurrency=8, requests=4)]


class FakeRedis:
    def flushdb(self) -> None:
        pass


def _plan() -> EnginePlan:
    setup = EngineSetup("real", EngineKind.VLLM, "vllm", "/models/m", None)
    return EnginePlan(setup, 8, 4, [(m, LOADS) for m in MODE_NAMES], api="openai", prompts=["p"] * 40,
                      kinds=["completions-stream", "chat"], interleave=True)


def _run(monkeypatch, tmp_path: Path, cannot_start: set[str] = frozenset(), fails_at: tuple | None = None,
         earlier: dict = EARLIER):
    events: list[tuple] = []

    def start_server(mode, setup, redis_url, log_dir, console=None):
        if mode.name in cannot_start:
            raise RuntimeError("no port")
        events.append(("start", mode.name))
        return Server(mode, f"http://{mode.name}", ("completions", "chat"), {}, log_dir,
                      _stop=lambda: events.append(("stop", mode.name)))

    def measure(plan, server, client, load, cfg, r, base, progress, step):
        events.append(("measure", server.mode.name, client.kind, load.label, base))
        if (server.mode.name, client.kind, load.label) == fails_at:
            raise RuntimeError("server gone")
        return {"engine": plan.setup.key, "mode": server.mode.name, "kind": client.kind, "load": load.label,
                "requests": load.requests, "summary": {"throughput_rps": 1.0, "output_tok_s": 1.0, "errors": 0,
                                                       "latency_s": {"p50": 0.1}, "ttft_s": None}}

    async def run_load(client, prompts, **kw):
        events.append(("warm", client.kind, kw["requests"]))
        return []

    monkeypatch.setattr(runner, "start_server", start_server)
    monkeypatch.setattr(runner, "_measure", measure)
    monkeypatch.setattr(runner, "run_load", run_load)
    console = Console(file=io.StringIO())
    progress = Progress(console=console)
    rows: list[dict] = [earlier]  # an earlier plan's row stays first
    run = _ModeRun(RunConfig(out=tmp_path), "redis://x", FakeRedis(), console, progress, progress.add_task("b"), rows)
    run.interleaved(_plan())
    return events, rows


def test_every_server_starts_first_and_each_point_is_taken_by_each_mode_in_turn(monkeypatch, tmp_path):
    events, rows = _run(monkeypatch, tmp_path)
    assert events[:2] == [("start", "pipeline-window50"), ("start", "vllm-serve")]
    assert events[-2:] == [("stop", "pipeline-window50"), ("stop", "vllm-serve")]
    measured = [e[1:4] for e in events if e[0] == "measure"]
    assert measured == [(m, k, ld.label) for k in ("completions-stream", "chat") for ld in LOADS for m in MODE_NAMES]
    # Each server's prompts go on where its last point left off; warm-ups: 2 at a server's first kind, 1 after.
    assert [e[4] for e in events if e[0] == "measure" and e[1] == "vllm-serve"] == [0, 2, 6, 8]
    assert [e[2] for e in events if e[0] == "warm"] == [2, 2, 1, 1]
    # Mode by mode, as a sequential run writes them, after the earlier plan's row.
    assert [(x["mode"], x.get("kind"), x["load"]) for x in rows[1:]] == [
        (m, k, ld.label) for m in MODE_NAMES for k in ("completions-stream", "chat") for ld in LOADS]
    assert rows[0] is EARLIER
    assert all("stop_s" in [x for x in rows if x["mode"] == m][-1] for m in MODE_NAMES)


def test_a_server_that_cannot_start_fails_its_own_points_only(monkeypatch, tmp_path):
    events, rows = _run(monkeypatch, tmp_path, cannot_start={"vllm-serve"})
    assert [e for e in events if e[0] in ("start", "stop")] == [("start", "pipeline-window50"), ("stop", "pipeline-window50")]
    failed = [x for x in rows if x.get("error")]
    assert len(failed) == 4 and {x["mode"] for x in failed} == {"vllm-serve"}
    assert all(x["error"] == "start failed: no port" for x in failed)
    assert len([e for e in events if e[0] == "measure"]) == 4


def test_servers_take_turns_on_a_cpu_and_run_one_after_another_on_a_gpu():
    assert interleaves(Device(Platform.CPU))
    assert not interleaves(Device(Platform.CUDA, "NVIDIA H200", 150 * 2**30))
    assert MODES["vllm-serve"].kind == "vllm-serve"


def test_a_server_that_fails_a_point_takes_no_more_turns(monkeypatch, tmp_path):
    events, rows = _run(monkeypatch, tmp_path, fails_at=("vllm-serve", "completions-stream", "c=8"))
    measured = [e[1:4] for e in events if e[0] == "measure"]
    assert [m for m in measured if m[0] == "vllm-serve"] == [("vllm-serve", "completions-stream", "c=1"),
                                                            ("vllm-serve", "completions-stream", "c=8")]
    assert len([m for m in measured if m[0] == "pipeline-window50"]) == 4  # the other goes on
    failed = [(x["kind"], x["load"]) for x in rows if x.get("error")]
    assert failed == [("completions-stream", "c=8"), ("chat", "c=1"), ("chat", "c=8")]
    assert {x["error"] for x in rows if x.get("error")} == {"server gone"}


def test_a_server_with_no_measured_row_puts_its_stop_time_on_no_other_engines_row(monkeypatch, tmp_path):
    earlier = {**EARLIER, "mode": "vllm-serve"}  # the same mode's row of an earlier engine
    events, rows = _run(monkeypatch, tmp_path, fails_at=("vllm-serve", "completions-stream", "c=1"), earlier=earlier)
    assert ("stop", "vllm-serve") in events
    assert "stop_s" not in rows[0]


def test_a_server_whose_every_point_failed_puts_its_stop_time_on_its_own_last_failed_row(monkeypatch, tmp_path):
    _, rows = _run(monkeypatch, tmp_path, fails_at=("vllm-serve", "completions-stream", "c=1"))
    failed = [x for x in rows if x["mode"] == "vllm-serve" and x["engine"] != EARLIER["engine"]]
    assert failed and all("error" in x for x in failed)
    assert "stop_s" in failed[-1] and not any("stop_s" in x for x in failed[:-1])
    measured = [x for x in rows if x["mode"] == "pipeline-window50" and x["engine"] != EARLIER["engine"]]
    assert "stop_s" in measured[-1] and "error" not in measured[-1]
