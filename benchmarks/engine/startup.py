"""Start-up seconds against tokens per second for vLLM's engine settings, on one model.

Each configuration starts the pipeline's own engine (llmpipe/engines/vllm_engine.py, vLLM's
engine core in a process of its own, as a worker runs it) in a fresh process, with the
compile caches in a folder of this run's own: once cold (empty caches), then warm (the
caches the first start left), then one batch of requests that all start together, to
report output tokens per second.

    python -m benchmarks.engine.startup --model smollm2 --out DIR [--configs default,eager]

Writes DIR/startup.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "default": {},  # vLLM's own: dtype auto, compiled
    "eager": {"enforce_eager": True},
    "float32-eager": {"enforce_eager": True, "dtype": "float32"},
}


def child(model: str, args: dict, requests: int, prompt_tokens: int, max_tokens: int) -> dict:
    """In a fresh process: start the engine, then generate one batch."""
    from llmpipe.engines.base import EngineRequest
    from llmpipe.engines.vllm_engine import VllmEngine
    from llmpipe.messages import SamplingParams

    t = time.monotonic()
    engine = VllmEngine(model, **args)
    start_s = time.monotonic() - t
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    batch = [EngineRequest(f"r{i}", [(7 * i + j) % 1000 + 100 for j in range(prompt_tokens)], params)
             for i in range(requests)]
    engine.generate(batch[:2])  # the first requests pay one-off costs
    t = time.monotonic()
    outs = engine.generate(batch)
    wall = time.monotonic() - t
    engine.shutdown()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"start_s": round(start_s, 1), "output_tokens": tokens, "wall_s": round(wall, 2),
            "output_tok_s": round(tokens / wall, 1)}


def run_one(model: str, name: str, cache: Path, a: argparse.Namespace) -> dict:
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), VLLM_HOST_IP="127.0.0.1")
    argv = [sys.executable, "-m", "benchmarks.engine.startup", "--child", json.dumps(CONFIGS[name]), "--model", model,
            "--requests", str(a.requests), "--prompt-tokens", str(a.prompt_tokens), "--max-tokens", str(a.max_tokens)]
    proc = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{name}: no result (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[7:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, default=Path("bench-results/startup"))
    p.add_argument("--configs", default="default,eager")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--child", default=None)
    a = p.parse_args()
    if a.child is not None:
        print("RESULT " + json.dumps(child(a.model, json.loads(a.child), a.requests, a.prompt_tokens, a.max_tokens)),
              flush=True)
        return
    from llmpipe.models.registry import resolve_model
    from llmpipe.settings import get_settings

    model = resolve_model(a.model, get_settings().models_dir)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.configs.split(","):
        cache = a.out / f"cache-{name}"
        subprocess.run(["rm", "-rf", str(cache)], check=True)
        cold = run_one(model, name, cache, a)
        warm = run_one(model, name, cache, a)
        rows.append({"config": name, "args": CONFIGS[name], "cold": cold, "warm": warm})
        print(f"{name}: cold {cold}, warm {warm}", flush=True)
    (a.out / "startup.json").write_text(json.dumps({"model": a.model, "rows": rows, "requests": a.requests,
                                                    "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens},
                                                   indent=2))
    print(f"| config | start cold (s) | start warm (s) | output tok/s (batch of {a.requests}) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['cold']['start_s']} | {r['warm']['start_s']} | "
              f"{r['cold']['output_tok_s']}, {r['warm']['output_tok_s']} |")


if __name__ == "__main__":
    main()
