"""``llmpipe batch submit|status|cancel|results``: the Batch API from the command line.

``submit FILE.jsonl`` uploads the file (``POST /v1/files``, purpose ``batch``) and creates
the batch (``POST /v1/batches``, the endpoint read from the file's first line unless
``--endpoint`` names it); with ``--wait`` it shows a progress bar until the batch ends and
prints where its results are. ``status`` prints the batch, ``cancel`` cancels it,
``results`` writes its output (and ``--errors``: its error file) to stdout or ``--out``.
Exit code 0 when the batch (or the command) succeeded, 1 otherwise.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from llmpipe.cli.client import _default_url, _error_text, _headers

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
ENDED = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0

_url = click.option("--url", default=_default_url, show_default="$LLMPIPE_URL or http://127.0.0.1:8000",
                    help="The API's base URL.")


def _client(url: str, timeout: float = 30.0) -> httpx.Client:
    return httpx.Client(base_url=url.rstrip("/"), timeout=httpx.Timeout(timeout, write=600.0), headers=_headers())


def _call(url: str, fn):
    """``fn(http)``, with a one-line error for what went wrong on the way."""
    try:
        with _client(url) as http:
            return fn(http)
    except httpx.ConnectError:
        raise click.ClickException(f"cannot reach the API at {url} (is `llmpipe up` running? --url or LLMPIPE_URL)") \
            from None
    except httpx.HTTPError as exc:
        raise click.ClickException(f"talking to {url}: {type(exc).__name__}: {exc}") from None


def _ok(r: httpx.Response, what: str) -> dict:
    if r.status_code != 200:
        raise click.ClickException(f"{what}: {r.status_code}: {_error_text(r)}")
    return r.json()


def endpoint_of(path: Path) -> str:
    """The ``url`` of the file's first request (every line must name the batch's endpoint)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                if url in ENDPOINTS:
                    return url
                break
    raise click.ClickException(f"{path}: the first line names no endpoint ({' or '.join(ENDPOINTS)}); "
                               "pass --endpoint")


def _summary(b: dict) -> str:
    c = b.get("request_counts") or {}
    line = (f"batch {b['id']}: {b['status']} ({c.get('completed', 0)} completed, {c.get('failed', 0)} failed "
            f"of {c.get('total', 0)})")
    for name in ("output_file_id", "error_file_id"):
        if b.get(name):
            line += f"\n  {name.removesuffix('_id').replace('_', ' ')}: {b[name]}"
    for e in ((b.get("errors") or {}).get("data") or [])[:20]:
        line += f"\n  line {e.get('line')}: {e.get('code')}: {e.get('message')}"
    return line


def wait_batch(url: str, batch_id: str, console: Console) -> dict:
    """Poll the batch with a progress bar until it ends; its last state."""
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn())
    with _client(url) as http, Progress(*cols, console=console, transient=False) as bar:
        task = bar.add_task(f"batch {batch_id}", total=None, info="validating")
        while True:
            b = _ok(http.get(f"/v1/batches/{batch_id}"), f"batch {batch_id}")
            c = b.get("request_counts") or {}
            done = c.get("completed", 0) + c.get("failed", 0)
            bar.update(task, total=c.get("total") or None, completed=done,
                       info=f"{b['status']}, {c.get('failed', 0)} failed")
            if b["status"] in ENDED:
                return b
            time.sleep(POLL_S)


@click.group()
def batch() -> None:
    """The OpenAI Batch API: submit a JSONL file of requests, follow it, get its results."""


@batch.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--endpoint", type=click.Choice(ENDPOINTS), help="Default: the url of the file's first line.")
@click.option("--window", "completion_window", default="24h", show_default=True,
              help="The completion window: 24h, or any whole number of s, m or h.")
@click.option("--wait", is_flag=True, help="Show a progress bar until the batch ends.")
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="Attach metadata (repeatable).")
@_url
def submit(file, endpoint, completion_window, wait, metadata, url):
    """Upload FILE (JSONL, one request per line) and start a batch of it; prints the batch id."""
    endpoint = endpoint or endpoint_of(file)
    meta = dict(m.split("=", 1) for m in metadata if "=" in m) or None

    def go(http: httpx.Client) -> dict:
        with open(file, "rb") as f:
            up = _ok(http.post("/v1/files", files={"file": (file.name, f, "application/jsonl")},
                               data={"purpose": "batch"}), f"uploading {file}")
        body = {"input_file_id": up["id"], "endpoint": endpoint, "completion_window": completion_window,
                **({"metadata": meta} if meta else {})}
        return _ok(http.post("/v1/batches", json=body), "creating the batch")

    b = _call(url, go)
    click.echo(b["id"])
    if wait:
        console = Console(stderr=True)
        try:
            b = wait_batch(url, b["id"], console)
        except KeyboardInterrupt:
            raise click.ClickException(f"interrupted; batch {b['id']} goes on: llmpipe batch status {b['id']}") \
                from None
        # Plain text, not the console's: a summary wrapped at the terminal's width breaks a grep.
        click.echo(_summary(b), err=True)
        if b["status"] != "completed":
            sys.exit(1)


@batch.command()
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="Print the whole batch object.")
@_url
def status(batch_id, as_json, url):
    """Print a batch's status, counts and files."""
    b = _call(url, lambda http: _ok(http.get(f"/v1/batches/{batch_id}"), f"batch {batch_id}"))
    click.echo(json.dumps(b, indent=2) if as_json else _summary(b))


@batch.command()
@click.argument("batch_id")
@_url
def cancel(batch_id, url):
    """Cancel a batch: feeding stops, its lines in flight are aborted; what finished is kept."""
    b = _call(url, lambda http: _ok(http.post(f"/v1/batches/{batch_id}/cancel"), f"batch {batch_id}"))
    click.echo(_summary(b))


@batch.command()
@click.argument("batch_id")
@click.option("--errors", is_flag=True, help="The error file instead of the output file.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write here instead of stdout.")
@_url
def results(batch_id, errors, out, url):
    """Write a batch's output file (or --errors: its error file), one JSON line per request."""
    def go(http: httpx.Client) -> None:
        b = _ok(http.get(f"/v1/batches/{batch_id}"), f"batch {batch_id}")
        fid = b.get("error_file_id" if errors else "output_file_id")
        if not fid:
            what = "error" if errors else "output"
            raise click.ClickException(f"batch {batch_id} ({b['status']}) has no {what} file"
                                       + ("" if b["status"] in ENDED else " yet"))
        with http.stream("GET", f"/v1/files/{fid}/content") as r:
            if r.status_code != 200:
                r.read()
                raise click.ClickException(f"file {fid}: {r.status_code}: {_error_text(r)}")
            sink = open(out, "wb") if out else sys.stdout.buffer  # noqa: SIM115 - closed below
            try:
                for chunk in r.iter_bytes():
                    sink.write(chunk)
            finally:
                if out:
                    sink.close()
                else:
                    sink.flush()
    _call(url, go)
