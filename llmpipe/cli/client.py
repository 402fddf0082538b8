"""``llmpipe submit``, ``llmpipe chat`` and ``llmpipe cancel``: a small client of a running API.

It submits one job, then long-polls ``GET /v1/jobs/{id}?wait=N`` with a spinner until the
job is done, and prints the text (``--json``: the whole job view). Exit code 0 when the
job succeeded, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import time

import click
import httpx
from rich.console import Console

POLL_WAIT_S = 10.0  # seconds one long-poll may wait on the server


def _headers() -> dict[str, str]:
    key = os.environ.get("LLMPIPE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _default_url() -> str:
    return os.environ.get("LLMPIPE_URL") or f"http://127.0.0.1:{os.environ.get('LLMPIPE_API_PORT', '8000')}"


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:300] or r.reason_phrase
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    return json.dumps(body)[:300]


def run_job(url: str, body: dict, timeout: float, console: Console) -> dict:
    """Submits ``body`` and returns the job's final view (or raises a one-line error)."""
    url = url.rstrip("/")
    end = time.monotonic() + timeout
    job_id = None
    try:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(10.0, read=POLL_WAIT_S + 10), headers=_headers()) as http:
            r = http.post("/v1/jobs", json=body)
            if r.status_code != 202:
                raise click.ClickException(f"the API refused the job ({r.status_code}): {_error_text(r)}")
            created = r.json()
            job_id = created["id"]
            status_url = created.get("status_url") or f"/v1/jobs/{job_id}"
            with console.status(f"job {job_id}: queued") as spin:
                while True:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    r = http.get(status_url, params={"wait": round(min(POLL_WAIT_S, max(left, 0.1)), 1)})
                    if r.status_code != 200:
                        raise click.ClickException(f"job {job_id}: {r.status_code}: {_error_text(r)}")
                    view = r.json()
                    spin.update(f"job {job_id}: {view.get('status', '?')}")
                    if view.get("status") not in ("queued", "running"):
                        return view
    except httpx.ConnectError:
        raise click.ClickException(f"cannot reach the API at {url} (is `llmpipe up` running? --url or LLMPIPE_URL)") from None
    except httpx.HTTPError as exc:
        raise click.ClickException(f"talking to {url}: {type(exc).__name__}: {exc}") from None
    except KeyboardInterrupt:
        raise click.ClickException(f"interrupted; job {job_id} goes on: {url}/v1/jobs/{job_id}" if job_id
                                   else "interrupted") from None
    raise click.ClickException(f"job {job_id}: not done after {timeout:g}s; see {url}/v1/jobs/{job_id}")


def _print(view: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(view, indent=2))
    if view.get("status") != "succeeded":
        err = view.get("error") or {}
        msg = err.get("message", "") if isinstance(err, dict) else str(err)
        raise click.ClickException(f"job {view.get('id', '')} {view.get('status')}" + (f": {msg}" if msg else ""))
    if not as_json:
        for r in (view.get("result") or {}).get("results", []):
            click.echo(r.get("text", ""))


_common = [
    click.option("--url", default=_default_url, show_default="$LLMPIPE_URL or http://127.0.0.1:8000",
                 help="The API's base URL."),
    click.option("--max-tokens", type=int, default=64, show_default=True),
    click.option("--temperature", type=float, default=0.0, show_default=True),
    click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds to wait for the result."),
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


@click.command()
@click.argument("job_id")
@click.option("--delete", is_flag=True, help="Also forget the job: a later GET answers 404.")
@click.option("--url", default=_default_url, show_default="$LLMPIPE_URL or http://127.0.0.1:8000",
              help="The API's base URL.")
def cancel(job_id, delete, url):
    """Cancel a job (POST /v1/jobs/{id}/cancel; it stays readable), or delete it (--delete:
    DELETE /v1/jobs/{id}, cancelled first if it still runs). Prints its last status."""
    try:
        with httpx.Client(base_url=url.rstrip("/"), timeout=10.0, headers=_headers()) as http:
            r = http.delete(f"/v1/jobs/{job_id}") if delete else http.post(f"/v1/jobs/{job_id}/cancel")
    except httpx.HTTPError as exc:
        raise click.ClickException(f"talking to {url}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise click.ClickException(f"job {job_id}: {r.status_code}: {_error_text(r)}")
    click.echo(f"job {job_id}: {r.json().get('status')}" + (" (deleted)" if delete else ""))
