"""`llmpipe submit` / `llmpipe chat` against a stand-in API: the request body, the
long-poll (`?wait=`), the printed text or JSON, and one-line errors with exit code 1.
(tests/llmpipe/local/test_up.py runs `llmpipe chat` against a real `llmpipe up`.)"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from click.testing import CliRunner

from llmpipe.cli import main


class FakeApi:
    def __init__(self):
        self.posts: list[dict] = []
        self.waits: list[float] = []
        self.final = {"status": "succeeded", "result": {"results": [{"index": 0, "text": "Paris."},
                                                                    {"index": 1, "text": "Rome."}]}}
        self.running_polls = 2
        self.post_status = 202
        self.ended: list[tuple[str, str]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                if self.path.endswith("/cancel"):
                    return self._ended("POST")
                api.posts.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                if api.post_status != 202:
                    return self._send(api.post_status, {"error": {"type": "invalid_request", "message": "max_tokens too big"}})
                self._send(202, {"id": "j1", "status": "queued", "status_url": "/v1/jobs/j1"})

            def do_DELETE(self):
                self._ended("DELETE")

            def _ended(self, method: str):
                api.ended.append((method, self.path))
                if not self.path.startswith("/v1/jobs/j1"):
                    return self._send(404, {"error": {"message": "no such job"}})
                self._send(200, {"id": "j1", "status": "cancelled"})

            def do_GET(self):
                url = urlparse(self.path)
                if url.path != "/v1/jobs/j1":
                    return self._send(404, {"error": {"message": "no such job"}})
                api.waits.append(float(parse_qs(url.query).get("wait", ["0"])[0]))
                if len(api.waits) <= api.running_polls:
                    return self._send(200, {"id": "j1", "status": "running", "result": None})
                self._send(200, {"id": "j1", **api.final})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture
def api():
    fake = FakeApi()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_chat_long_polls_and_prints_text(api):
    result = run("chat", "--url", api.url, "What is the capital of France?", "--max-tokens", "16")
    assert result.exit_code == 0, result.output
    assert result.stdout == "Paris.\nRome.\n"
    assert api.posts == [{"messages": [{"role": "user", "content": "What is the capital of France?"}],
                          "max_tokens": 16, "temperature": 0.0}]
    assert len(api.waits) == 3 and all(0 < w <= 10 for w in api.waits)  # long-poll, not a busy loop


def test_chat_with_system_and_submit_prompts(api):
    assert run("chat", "--url", api.url, "--system", "Be brief.", "Hi").exit_code == 0
    assert api.posts[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    api.waits.clear()
    result = run("submit", "--url", api.url, "one", "two")
    assert result.exit_code == 0 and result.stdout == "Paris.\nRome.\n"
    assert api.posts[1] == {"prompts": ["one", "two"], "max_tokens": 64, "temperature": 0.0}


def test_json_prints_the_whole_view(api):
    api.running_polls = 0
    result = run("chat", "--url", api.url, "--json", "Hi")
    assert result.exit_code == 0
    view = json.loads(result.stdout)
    assert view["status"] == "succeeded" and view["result"]["results"][0]["text"] == "Paris."


def test_failed_job_is_exit_1_with_reason(api):
    api.running_polls = 0
    api.final = {"status": "failed", "result": None, "error": {"type": "engine_error", "message": "engine died"}}
    result = run("chat", "--url", api.url, "Hi")
    assert result.exit_code == 1
    assert "job j1 failed: engine died" in result.output and "Traceback" not in result.output


def test_refused_job_is_one_line(api):
    api.post_status = 400
    result = run("submit", "--url", api.url, "Hi")
    assert result.exit_code == 1
    assert "the API refused the job (400): max_tokens too big" in result.output


def test_timeout_is_one_line(api):
    api.running_polls = 10**6
    result = run("chat", "--url", api.url, "--timeout", "0.5", "Hi")
    assert result.exit_code == 1 and "not done after 0.5s" in result.output


def test_unreachable_api_is_one_line(monkeypatch):
    from llmpipe.local.redis_server import free_port

    monkeypatch.setenv("LLMPIPE_URL", f"http://127.0.0.1:{free_port()}")
    result = run("chat", "Hi")
    assert result.exit_code == 1
    assert "cannot reach the API" in result.output and "Traceback" not in result.output


def test_cancel_keeps_the_job_and_delete_forgets_it(api):
    result = run("cancel", "--url", api.url, "j1")
    assert result.exit_code == 0 and result.stdout == "job j1: cancelled\n"
    result = run("cancel", "--url", api.url, "--delete", "j1")
    assert result.exit_code == 0 and result.stdout == "job j1: cancelled (deleted)\n"
    assert api.ended == [("POST", "/v1/jobs/j1/cancel"), ("DELETE", "/v1/jobs/j1")]
    result = run("cancel", "--url", api.url, "nope")
    assert result.exit_code == 1 and "job nope: 404: no such job" in result.output
