"""Does the engine batch? One batch of 32 requests against the same 32 requests one at a
time, on the engine the pipeline uses (``create_engine``, so the platform's dtype and
device), with the same prompts and output length as the run.

    python -m benchmarks.gpu.batch_check --model DIR --out batch.json [--engine transformers]

Prints and writes the times; a measurement for the report, not a test with a threshold.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmpipe.engines.base import Engine, EngineRequest
from llmpipe.messages import SamplingParams


def _requests(prompts: list[list[int]], max_tokens: int, tag: str) -> list[EngineRequest]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [EngineRequest(f"{tag}-{i}", ids, params) for i, ids in enumerate(prompts)]


def measure(engine: Engine, prompts: list[list[int]], max_tokens: int, *, max_singles_s: float = 120.0,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Time ``generate`` on all of ``prompts`` as one batch, then on each alone, in order,
    until all are done or ``max_singles_s`` has passed (the rest is then estimated from
    the mean, and said to be). One warm-up of each shape first."""
    n = len(prompts)
    engine.generate(_requests(prompts[:1], max_tokens, "warm1"))
    engine.generate(_requests(prompts, max_tokens, "warmb"))
    t0 = clock()
    outs = engine.generate(_requests(prompts, max_tokens, "batch"))
    batch_s = clock() - t0
    timed = {"batch": _timing(engine)}
    singles: list[float] = []
    started = clock()
    for i, ids in enumerate(prompts):
        if singles and clock() - started > max_singles_s:
            break
        t0 = clock()
        engine.generate(_requests([ids], max_tokens, f"one{i}"))
        singles.append(clock() - t0)
        if "single" not in timed:
            timed["single"] = _timing(engine)
    mean = sum(singles) / len(singles)
    all_singles = sum(singles) if len(singles) == n else mean * n
    return {
        "requests": n, "prompt_tokens_mean": sum(map(len, prompts)) / n, "max_tokens": max_tokens,
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "batch_s": batch_s, "single_s_mean": mean, "singles_measured": len(singles),
        "singles_total_s": all_singles, "singles_total_estimated": len(singles) < n,
        "speedup": all_singles / batch_s if batch_s > 0 else None,
        "timing": timed,  # the engine's own split of the batch and of the first single, where it keeps one
    }


def _timing(engine: Engine) -> str | None:
    last = getattr(engine, "last_batch", None)  # the transformers engine's (llmpipe/engines/batch_timing.py)
    return last.describe() if last is not None else None


def describe(r: dict[str, Any]) -> str:
    how = (f"measured all {r['requests']}" if not r["singles_total_estimated"] else
           f"{r['singles_measured']} measured, the rest estimated from their mean")
    return (f"one batch of {r['requests']}: {r['batch_s']:.2f} s; the same {r['requests']} one at a time: "
            f"{r['singles_total_s']:.2f} s ({how}; {r['single_s_mean']:.3f} s each): the batch costs "
            f"{1 / r['speedup'] * 100:.1f} % of the singles ({r['speedup']:.1f}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="batch_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", default="transformers")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-singles-s", type=float, default=120.0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from llmpipe.bench.prompts import make_prompts
    from llmpipe.engines.factory import create_engine
    from llmpipe.engines.platform import engine_config
    from llmpipe.settings import Settings

    s = Settings(model=a.model, engine=a.engine, max_batch_size=a.batch,
                 max_model_len=a.prompt_tokens + a.max_tokens + 64)
    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = [tok(p)["input_ids"] for p in make_prompts(tok, a.batch, a.prompt_tokens, seed=7)]
    t0 = time.monotonic()
    engine = create_engine(s, model_path=a.model)
    load_s = time.monotonic() - t0
    dtype = str(getattr(getattr(engine, "_model", None), "dtype", "")) or None
    try:
        result = measure(engine, prompts, a.max_tokens, max_singles_s=a.max_singles_s)
    finally:
        engine.shutdown()
    cfg = engine_config(s)
    result.update(engine=a.engine, platform=cfg.platform.value, engine_args={k: str(v) for k, v in cfg.args.items()},
                  model_load_s=load_s, dtype=dtype, device=getattr(engine, "device", None))
    a.out.write_text(json.dumps(result, indent=1))
    print(describe(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
