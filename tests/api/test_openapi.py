"""The OpenAPI document says what the API does (issue 17): limits from the settings, one
input of three, every status of every route from the one error table, Allow, deletion.
Real Redis, no workers."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.errors import ERROR_TABLE
from api.openapi import ROUTE_ERRORS
from llmpipe.settings import Settings

LIMITS = dict(max_tokens_limit=100, max_n=3, max_prompts_per_job=4, max_prompt_chars=50, max_logprobs=5)


@pytest.fixture
def client(redis_client, redis_url, tmp_path):
    from api.app import create_app

    with TestClient(create_app(Settings(redis_url=redis_url, state_dir=tmp_path, **LIMITS))) as c:
        yield c


def _schemas(client) -> dict:
    return client.get("/openapi.json").json()["components"]["schemas"]


def _nullable(prop: dict) -> dict:
    """The non-null branch of ``X | None``."""
    return next((b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"), prop)


def test_the_schema_states_the_limits_of_the_settings(client):
    s = _schemas(client)
    assert _nullable(s["JobPrompt"]["properties"]["max_tokens"])["maximum"] == 100
    assert s["JobPrompt"]["properties"]["prompt"] == {"maxLength": 50, "minLength": 1, "title": "Prompt", "type": "string"}
    prompts = s["JobPrompts"]["properties"]["prompts"]
    assert prompts["maxItems"] == 4 and prompts["items"]["maxLength"] == 50 and prompts["items"]["minLength"] == 1
    assert _nullable(s["JobMessage"]["properties"]["content"])["maxLength"] == 50  # null: an assistant turn of tool calls
    comp = s["CompletionRequest"]["properties"]
    assert comp["n"]["maximum"] == 3 and _nullable(comp["max_tokens"])["maximum"] == 100
    assert _nullable(comp["logprobs"])["maximum"] == 5 and _nullable(comp["logprobs"])["minimum"] == 0
    chat = s["ChatCompletionRequest"]["properties"]
    assert _nullable(chat["max_completion_tokens"])["maximum"] == 100 and _nullable(chat["top_logprobs"])["maximum"] == 5
    assert comp["use_beam_search"]["enum"] == [None, False]  # a field llmpipe refuses unless it asks for nothing
    # vLLM's sampling fields, with their limits (api/openai/sampling.py checks them with vLLM's messages)
    assert comp["presence_penalty"]["minimum"] == -2 and comp["presence_penalty"]["maximum"] == 2
    assert comp["top_k"]["minimum"] == -1 and comp["min_p"]["maximum"] == 1 and comp["min_tokens"]["minimum"] == 0
    assert _nullable(comp["truncate_prompt_tokens"])["minimum"] == -1
    assert {"structured_outputs", "bad_words", "allowed_token_ids", "logit_bias"} <= comp.keys()
    # vLLM's older guided_* names are taken but not documented, as in vLLM's own document
    assert not {"guided_json", "guided_regex", "guided_choice", "guided_grammar"} & (comp.keys() | chat.keys())
    assert {"tools", "tool_choice", "chat_template_kwargs", "continue_final_message", "documents"} <= chat.keys()


def test_each_app_validates_and_documents_its_own_limits(client, redis_url, tmp_path):
    from api.app import create_app

    with TestClient(create_app(Settings(redis_url=redis_url, state_dir=tmp_path, max_tokens_limit=7))) as other:
        assert _nullable(_schemas(other)["JobPrompt"]["properties"]["max_tokens"])["maximum"] == 7
        assert other.post("/v1/jobs", json={"prompt": "x", "max_tokens": 8}).status_code == 400
        assert client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 8}).status_code == 202
    r = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 101})
    assert r.status_code == 400 and r.json()["error"]["type"] == "limit_exceeded"
    assert "max_tokens_limit" in r.json()["error"]["message"] and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json={"prompt": "x", "n": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "max_n" in r.json()["error"]["message"]
    r = client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "y" * 51}]})
    assert r.status_code == 400 and "max_prompt_chars" in r.json()["error"]["message"]


def test_a_job_takes_exactly_one_input_and_the_schema_says_so(client):
    body = client.get("/openapi.json").json()["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
    assert [b["$ref"].rsplit("/", 1)[1] for b in body["schema"]["oneOf"]] == ["JobPrompt", "JobPrompts", "JobMessages"]
    r = client.post("/v1/jobs", json={"prompt": "x", "prompts": ["y"]})
    assert r.status_code == 422 and "exactly one of prompt, prompts or messages" in r.json()["error"]["message"]
    assert client.post("/v1/jobs", json={"prompt": "x", "prompts": None, "messages": None}).status_code == 202
    assert client.post("/v1/jobs", json={"prompts": ["x", ""]}).json()["error"]["param"] == "prompts.1"


def test_fields_take_json_types_only(client):
    for bad in ({"max_tokens": "5"}, {"ignore_eos": 1}, {"temperature": "0.5"}, {"seed": True}):
        r = client.post("/v1/jobs", json={"prompt": "x", **bad})
        assert r.status_code == 422 and r.json()["error"]["param"] == next(iter(bad)), (bad, r.text)
    assert client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 2.0}).status_code == 202  # JSON's integer
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_every_route_documents_the_statuses_of_the_error_table(client):
    spec = client.get("/openapi.json").json()
    ops = {(m.upper(), p): op for p, methods in spec["paths"].items() for m, op in methods.items()}
    assert set(ops) == set(ROUTE_ERRORS)  # a new route is added to ROUTE_ERRORS, or this fails
    statuses = {r.status for r in ERROR_TABLE}
    for key, op in ops.items():
        errors = {int(c) for c in op["responses"] if int(c) >= 400}
        assert errors == set(ROUTE_ERRORS[key]) | {500} | ({401, 403} if key not in {
            ("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"), ("GET", "/healthz")} else set()), key
        assert errors <= statuses, key
        for c in errors:
            resp = op["responses"][str(c)]
            assert resp["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
            assert resp["description"] == "; ".join(r.description for r in ERROR_TABLE if r.status == c)
    assert {424, 504, 409} <= {int(c) for c in ops[("POST", "/v1/chat/completions")]["responses"]}
    assert "content" not in ops[("GET", "/health")]["responses"]["200"]  # an empty body, as vLLM's
    assert "text/event-stream" in ops[("POST", "/v1/completions")]["responses"]["200"]["content"]
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_options_and_methods_a_path_lacks_answer_with_allow(client):
    r = client.options("/v1/jobs/some-id")
    assert r.status_code == 204 and r.headers["allow"] == "DELETE, GET, OPTIONS"
    r = client.patch("/v1/jobs/some-id")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, OPTIONS"
    assert r.json()["error"]["type"] == "invalid_request" and r.json()["error"]["code"] == 405
    assert client.options("/v1/jobs").headers["allow"] == "OPTIONS, POST"
    assert client.get("/no/such/path").status_code == 404


def test_delete_cancels_then_forgets_the_job_and_cancel_keeps_it(client, redis_client):
    from llmpipe.jobs.store import DEADLINE_INDEX

    job_id = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    r = client.delete(f"/v1/jobs/{job_id}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert redis_client.exists(f"llmpipe:cancelled:{job_id}")  # its workers drop the work in flight
    assert client.get(f"/v1/jobs/{job_id}").status_code == 404
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 404
    assert redis_client.zscore(DEADLINE_INDEX, job_id) is None

    kept = client.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    assert client.post(f"/v1/jobs/{kept}/cancel").json()["status"] == "cancelled"
    assert client.get(f"/v1/jobs/{kept}").json()["status"] == "cancelled"


def test_a_chat_messages_content_parts_are_limited_each_on_its_own_as_the_schema_says(client):
    def chat(*parts):
        return client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in parts]}],
            "max_tokens": 1, "timeout": 0.2})

    # two parts of 30 characters: each within max_prompt_chars (50), 60 together; no worker
    # runs here, so the accepted request ends at its own timeout (504), never 400
    r = chat("a" * 30, "b" * 30)
    assert r.status_code == 504, r.text
    r = chat("a" * 51)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
