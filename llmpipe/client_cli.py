"""``llmpipe submit`` and ``llmpipe chat``: a small client of a running API."""

from __future__ import annotations

import json
import os
import time

import click
import httpx
from rich.console import Console


def _headers() -> dict[str, str]:
    key = os.environ.get("LLMPIPE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def run_job(url: str, body: dict, timeout: float, console: Console) -> dict:
    with httpx.Client(base_url=url, timeout=10, headers=_headers()) as http:
        r = http.post("/v1/jobs", json=body)
        if r.status_code != 202:
            raise click.ClickException(f"{r.status_code}: {r.json().get('error', {}).get('message', r.text)}")
        status_url = r.json()["status_url"]
        end = time.monotonic() + timeout
        with console.status("queued") as spin:
            while time.monotonic() < end:
                view = http.get(status_url).json()
                spin.update(view.get("status", "?"))
                if view.get("status") not in ("queued", "running"):
                    return view
                time.sleep(0.1)
    raise click.ClickException(f"no result after {timeout}s")


def _print(view: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(view, indent=2))
        return
    if view.get("status") != "succeeded":
        err = view.get("error") or {}
        raise click.ClickException(f"job {view.get('status')}: {err.get('message', '')}")
    for r in view["result"]["results"]:
        click.echo(r["text"])


_common = [
    click.option("--url", default=lambda: os.environ.get("LLMPIPE_URL", "http://127.0.0.1:8000"), show_default="http://127.0.0.1:8000"),
    click.option("--max-tokens", type=int, default=64),
    click.option("--temperature", type=float, default=0.0),
    click.option("--timeout", type=float, default=120.0),
    click.option("--json", "as_json", is_flag=True, help="Print the full job view as JSON."),
]


def _with_common(f):
    for opt in reversed(_common):
        f = opt(f)
    return f


@click.command()
@click.argument("prompts", nargs=-1, required=True)
@_with_common
def submit(prompts, url, max_tokens, temperature, timeout, as_json):
    """Submit plain prompts as one job and print the results in order."""
    body = {"prompts": list(prompts), "max_tokens": max_tokens, "temperature": temperature}
    _print(run_job(url, body, timeout, Console(stderr=True)), as_json)


@click.command()
@click.argument("message")
@click.option("--system", help="A system message.")
@_with_common
def chat(message, system, url, max_tokens, temperature, timeout, as_json):
    """Ask one chat question with the model's chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    _print(run_job(url, body, timeout, Console(stderr=True)), as_json)
