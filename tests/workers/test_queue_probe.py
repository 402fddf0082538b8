"""The inference worker's queue probe (workers/inference_runtime.py): does a message wait in any lane?"""

import json

from llmpipe.jobs.lanes import queue_keys
from workers.inference_runtime import queue_probe


def test_the_probe_sees_a_message_in_any_lane_and_nothing_in_empty_lanes(redis_client):
    probe = queue_probe(redis_client, "inference")
    assert probe() is False
    for key in queue_keys("inference"):
        redis_client.lpush(key, json.dumps({"body": "x"}))
        assert probe() is True
        redis_client.rpop(key)  # Redis deletes the emptied list
        assert probe() is False
