"""The priority field (vLLM's extension, llmpipe/jobs/lanes.py) at the API, against a real Redis
with no workers: its range in the schema and in validation, the lane's broker priority on
every stage's message, and each lane's admission budget."""

from __future__ import annotations

import base64
import json

import pytest
from fastapi.testclient import TestClient

from llmpipe.jobs.lanes import PRIORITY_MAX, PRIORITY_MIN, Lane, broker_priority, queue_keys
from llmpipe.settings import Settings


@pytest.fixture
def client(redis_client, redis_url, tmp_path):
    from api.app import create_app

    with TestClient(create_app(Settings(redis_url=redis_url, state_dir=tmp_path, max_queue_depth=4))) as c:
        yield c


@pytest.mark.parametrize("value", [PRIORITY_MIN - 1, PRIORITY_MAX + 1, "1", 1.5])
def test_a_priority_out_of_range_or_not_an_int_is_422_naming_the_field(client, value):
    r = client.post("/v1/jobs", json={"prompt": "x", "priority": value})
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "invalid_request" and r.json()["error"]["param"] == "priority"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_the_openai_routes_refuse_it_as_vllm_refuses_a_bad_body_naming_the_field(client, path, body):
    r = client.post(path, json={**body, "priority": PRIORITY_MAX + 1})
    assert r.status_code == 400  # every invalid body on the OpenAI routes (api/errors.py)
    assert r.json()["error"]["param"] == "priority"


def test_the_schema_states_the_range_everywhere(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("JobPrompt", "JobPrompts", "JobMessages", "CompletionRequest", "ChatCompletionRequest"):
        prop = schemas[name]["properties"]["priority"]
        assert (prop["type"], prop["minimum"], prop["maximum"], prop["default"]) == ("integer", PRIORITY_MIN, PRIORITY_MAX, 0)
        assert "enum" not in prop  # no longer an unsupported field


def _messages(r, queue="preprocess"):
    return {k: [json.loads(m) for m in r.lrange(k, 0, -1)] for k in queue_keys(queue)}


def test_each_lane_goes_to_its_own_priority_list_with_its_priority_carried_for_every_stage(client, redis_client):
    assert client.post("/v1/jobs", json={"prompt": "x"}).status_code == 202
    assert client.post("/v1/jobs", json={"prompt": "y", "priority": 5}).status_code == 202
    lists = _messages(redis_client)
    inter, batch = lists[queue_keys("preprocess")[0]], lists[queue_keys("preprocess")[-1]]
    assert len(inter) == 1 and len(batch) == 1
    for msg, lane, priority in ((inter[0], Lane.INTERACTIVE, 0), (batch[0], Lane.BATCH, 5)):
        assert msg["properties"]["priority"] == broker_priority(lane)
        args, _kwargs, embed = json.loads(base64.b64decode(msg["body"]))
        assert args[0].get("priority", 0) == priority  # the stage message, for the batcher and the engine
        # the chain's next stages carry the lane's priority too (a single-prompt job is one
        # chain: its postprocess collects it, no chord)
        assert [t["options"]["priority"] for t in embed["chain"]] == [broker_priority(lane)] * 2
        assert "chord" not in embed["chain"][0]["options"]  # Celery keeps the chain's rest last task first


def test_a_multi_prompt_jobs_chord_callback_carries_its_lane_priority(client, redis_client):
    assert client.post("/v1/jobs", json={"prompts": ["a", "b"], "priority": 5}).status_code == 202
    batch = _messages(redis_client)[queue_keys("preprocess")[-1]]
    assert len(batch) == 2
    for msg in batch:
        assert msg["properties"]["priority"] == broker_priority(Lane.BATCH)
        _args, _kwargs, embed = json.loads(base64.b64decode(msg["body"]))
        assert embed["chain"][0]["options"]["chord"]["options"]["priority"] == broker_priority(Lane.BATCH)


def test_the_batch_lane_is_refused_first(client):
    # max_queue_depth 4, lane_batch_share 0.5: the batch lane stops at 2, interactive at 4
    codes = [client.post("/v1/jobs", json={"prompt": "x", "priority": 9}).status_code for _ in range(3)]
    assert codes == [202, 202, 429]
    r = client.post("/v1/jobs", json={"prompt": "x", "priority": 9})
    assert r.status_code == 429 and "batch lane" in r.json()["error"]["message"]
    assert [client.post("/v1/jobs", json={"prompt": "x"}).status_code for _ in range(3)] == [202, 202, 429]
