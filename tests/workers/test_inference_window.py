"""The inference worker's window under the batch lane, as start_inference wires it
(workers/inference_runtime.py) on real Redis: batch lines queued in the broker do not hold an
interactive request for the window."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from llmpipe.engines.noop import NoopEngine
from llmpipe.jobs.lanes import Lane, queue_keys
from llmpipe.messages import SamplingParams, TokenizedRequest
from llmpipe.models.served import ServedModel
from llmpipe.settings import Settings
from workers.inference_runtime import start_inference


def test_an_interactive_request_does_not_wait_out_the_window_for_queued_batch_lines(redis_client):
    s = Settings(batch_window_ms=60_000.0)  # a window no request could wait out in the test
    assert not s.broker_is_amqp
    rt = start_inference(NoopEngine(), redis_client, s, ServedModel("m", "m", "inference"))
    try:
        redis_client.lpush(queue_keys("inference", Lane.BATCH)[0], b"a batch line")
        req = TokenizedRequest(job_id="j", index=0, deadline=4e9, enqueued_at=0.0, prompt_token_ids=[1, 2, 3],
                               params=SamplingParams(max_tokens=2))
        with ThreadPoolExecutor(1) as pool:
            out = pool.submit(rt.processor.process, req).result(timeout=20)
        assert out.error is None and len(out.output_token_ids) == 2
    finally:
        rt.shutdown()
