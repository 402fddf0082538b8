"""The run's PNG figures: a latency CDF per engine (one panel per request kind) and, where a
run took several loads, throughput and p99 against load.

matplotlib is the ``[bench]`` extra, not a runtime dependency: it is imported here only,
when the figures are drawn; ``missing()`` tells before a run starts.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

BENCH_EXTRA = "pip install -e '.[bench]' (scripts/bootstrap.sh installs it; `make bench` runs bootstrap)"


def missing() -> str | None:
    """What to install for the plots, or None when matplotlib is there."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"matplotlib is not installed, so this run writes no plots: {BENCH_EXTRA}"
    return None


def _series(r: dict) -> str:
    kind = r.get("kind", "jobs")
    return r["mode"] if kind == "jobs" else f"{r['mode']} {kind}"


def plots(result: dict, out: Path) -> dict[str, list[str]]:
    """engine -> the file names written under ``out``. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: dict[str, list[str]] = {}
    for plan in result["plans"]:
        key, label = plan["engine"], plan["label"]
        rows = [r for r in result["rows"] if r["engine"] == key and "summary" in r]
        if not rows:
            continue
        made[key] = [_cdf(plt, rows, label, out / f"latency_cdf_{key}.png")]
        xkey = "concurrency" if rows[0]["concurrency"] is not None else "rate"
        if len({r[xkey] for r in rows}) >= 2:
            made[key].append(_against_load(plt, rows, label, xkey, out / f"scaling_{key}.png"))
    return made


def _cdf(plt, rows: list[dict], label: str, path: Path) -> str:
    """Per request kind, each mode's latency CDF at its highest load."""
    import matplotlib.ticker

    kinds = list(dict.fromkeys(r.get("kind", "jobs") for r in rows))
    cols = 1 if len(kinds) == 1 else 2
    n_rows = -(-len(kinds) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(7 * cols, 4.5 * n_rows), squeeze=False)
    for ax, kind in zip(axes.flat, kinds, strict=False):
        kr = [r for r in rows if r.get("kind", "jobs") == kind]
        for m in dict.fromkeys(r["mode"] for r in kr):
            top = [r for r in kr if r["mode"] == m][-1]
            xs = [x * 1000 for x in top["cdf"]]
            if xs:
                ax.step([xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], where="post",
                        label=f"{m} ({top['load']}, n={len(xs)})")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(kind if len(kinds) > 1 else f"Latency CDF: {label}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(kinds):]:
        ax.set_visible(False)
    if len(kinds) > 1:
        fig.suptitle(f"Latency CDF: {label}", fontsize=10)
    return _save(plt, fig, path)


def _against_load(plt, rows: list[dict], label: str, xkey: str, path: Path) -> str:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(_series(r) for r in rows):
        sr = sorted((r for r in rows if _series(r) == name), key=lambda r: r[xkey])
        x = [r[xkey] for r in sr]
        a1.plot(x, [r["summary"]["throughput_rps"] for r in sr], marker="o", label=name)
        a2.plot(x, [(r["summary"]["latency_s"]["p99"] or 0) * 1000 for r in sr], marker="o", label=name)
    for a, yl in ((a1, "throughput (req/s)"), (a2, "p99 latency (ms)")):
        a.set_xlabel("concurrency (closed loop)" if xkey == "concurrency" else "offered rate (req/s)")
        a.set_ylabel(yl)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    a2.set_yscale("log")
    fig.suptitle(f"Throughput and p99 against load: {label}", fontsize=10)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
