"""The inference worker's queue probe (workers/inference_runtime.py): does a message wait in any lane?"""

import json

from llmpipe.jobs.lanes import Lane, queue_keys
from workers.inference_runtime import queue_probe


def test_the_probe_sees_a_message_in_any_lane_and_nothing_in_empty_lanes(redis_client):
    probe = queue_probe(redis_client, "inference")
    assert probe() is False
    for key in queue_keys("inference"):
        redis_client.lpush(key, json.dumps({"body": "x"}))
        assert probe() is True
        redis_client.rpop(key)  # Redis deletes the emptied list
        assert probe() is False


def test_the_interactive_probe_sees_only_the_interactive_lane(redis_client):
    """The batcher's probe while the batch lane is held to its share (llmpipe/processors/batching.py)."""
    interactive, every = queue_probe(redis_client, ("inference", "own"), lane=Lane.INTERACTIVE), queue_probe(
        redis_client, ("inference", "own"))
    assert queue_keys("inference", Lane.BATCH) == [queue_keys("inference")[-1]]
    redis_client.lpush(queue_keys("own", Lane.BATCH)[0], json.dumps({"body": "batch line"}))
    assert every() is True and interactive() is False
    for key in queue_keys("own", Lane.INTERACTIVE):
        redis_client.lpush(key, json.dumps({"body": "chat"}))
        assert interactive() is True
        redis_client.rpop(key)
    assert interactive() is False
