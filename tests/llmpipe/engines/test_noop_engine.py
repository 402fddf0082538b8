from __future__ import annotations

from llmpipe.engines.base import EngineRequest
from llmpipe.engines.noop import NoopEngine
from llmpipe.messages import FinishReason, SamplingParams


def test_noop_returns_max_tokens_at_once():
    e = NoopEngine()
    assert e.continuous is True
    calls = []
    batch = [
        EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=4)),
        EngineRequest("b", [9], SamplingParams(max_tokens=1, stop_token_ids=[9])),
    ]
    out = e.generate(batch, on_tokens=lambda rid, toks: calls.append((rid, toks)))
    assert [o.request_id for o in out] == ["a", "b"]
    assert out[0].token_ids == [3, 3, 3, 3]
    assert out[1].token_ids == [9]
    assert all(o.finish_reason is FinishReason.LENGTH and o.first_token_at for o in out)
    assert calls == [("a", [3, 3, 3, 3]), ("b", [9])]
    assert e.generate([]) == []
    e.shutdown()
