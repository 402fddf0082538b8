"""Prefix-aware routing end to end (docs/architecture.md, "Prefix-aware routing"): two vLLM
workers of the tiny model, prompts hashed by the engines' own KV-cache block (vLLM on the
CPU: 128 tokens, which the workers report). Requests that share a prompt prefix go to the
worker that served it before, where vLLM's prefix cache has it: every repeat hits the cache
on that worker, and its hits count on that worker only."""

from __future__ import annotations

import re

import httpx
import pytest

from llmpipe.routing.keys import prefix_key
from llmpipe.routing.prefix import block_hashes
from tests.harness.multiworker import SHARED, inference_children, is_member, own_queue, start_workers_pipe
from tests.harness.waiting import wait_until

pytestmark = pytest.mark.integration

PREFIXES = 3
REPEATS = 4
BLOCK = 128  # vLLM's block on the CPU


@pytest.fixture(scope="module")
def pipe(tmp_path_factory, tiny_model):
    from tests.harness.pipe import stop_pipe

    p = start_workers_pipe(tmp_path_factory.mktemp("routing"), model=tiny_model, route_block_size=None)
    wait_until(lambda: all(is_member(p, c) for c in inference_children(p)), 60, "both workers in routing")
    yield p
    stop_pipe(p)


def _prompts(tokenizer) -> list[list[str]]:
    """PREFIXES groups of prompts: a shared part of 2-3 blocks (its own words from the first
    token on), then a question of its own per prompt."""
    groups = []
    for g in range(PREFIXES):
        shared = f"group {g}:"
        while len(tokenizer(shared)["input_ids"]) < 2 * BLOCK + 10:
            shared += f" w{g}x{len(shared)}"
        assert len(tokenizer(shared)["input_ids"]) < 3 * BLOCK - 10
        groups.append([f"{shared} question {q}?" for q in range(REPEATS)])
    return groups


def _metric(text: str, name: str, **labels) -> dict[str, float]:
    """``name``'s samples whose labels include ``labels``, by their ``worker`` label."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}{{(.*)}} (\S+)$", line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            out[got.get("worker", "")] = out.get(got.get("worker", ""), 0.0) + float(m.group(2))
    return out


def test_requests_sharing_a_prefix_go_where_it_is_cached(pipe, tiny_tokenizer):
    groups = _prompts(tiny_tokenizer)
    for prompts in groups:
        for text in prompts:  # one at a time: no load to spill for
            job = pipe.submit({"prompt": text, "max_tokens": 4, "temperature": 0})
            assert pipe.wait_all([job], timeout=60)[job]["status"] == "succeeded"
    # where each shared part went (its two-block prefix, as preprocess hashed it)
    home = {}
    for g, prompts in enumerate(groups):
        ids = tiny_tokenizer(prompts[0])["input_ids"]
        home[g] = pipe.r.get(prefix_key(SHARED, block_hashes(ids, BLOCK)[1])).decode()
    assert set(home.values()) <= {own_queue(pipe, c) for c in inference_children(pipe)}
    # every repeat found its two shared blocks in its worker's prefix cache, and only there
    expected = {c: 2 * BLOCK * (REPEATS - 1) * sum(1 for q in home.values() if q == own_queue(pipe, c))
                for c in inference_children(pipe)}

    def hits() -> dict[str, float]:
        text = httpx.get(f"{pipe.lp.api_url}/metrics", timeout=10).text
        by_node = _metric(text, "llmpipe_engine_prefix_cache_hits_total", model="tiny")
        return {c: by_node.get(pipe.node(c), 0.0) for c in inference_children(pipe)}

    wait_until(lambda: hits() == expected, 30, f"prefix-cache hits {expected} (the engines report each second)")
    text = httpx.get(f"{pipe.lp.api_url}/metrics", timeout=10).text
    routed = _metric(text, "llmpipe_route_requests_total", model="tiny", outcome="routed", match="prefix")
    assert sum(routed.values()) == PREFIXES * (REPEATS - 1)
    assert pipe.http.get("/healthz").json()["live_workers"]["inference"] == 2
