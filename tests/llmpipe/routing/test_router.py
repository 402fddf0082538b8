"""Prefix-aware routing (llmpipe/routing/router.py) on a real Redis, with the time passed in
(the scripts' injectable clock) instead of slept: placement by prefix, bounded loads, spills,
dead workers, the single-worker case and a backlog in the shared queue."""

from __future__ import annotations

import hashlib

import pytest

from llmpipe.jobs.lanes import Lane, queue_keys
from llmpipe.routing.keys import BACKLOG_KEY, LOAD_KEY, prefix_key
from llmpipe.routing.members import RouteMember
from llmpipe.routing.prefix import block_hashes
from llmpipe.routing.router import (DEFAULT_BLOCK_SIZE, FALLBACK, QUEUED, ROUTED, SINGLE, SPILLED, Placement,
                                    PrefixRouter)
from llmpipe.stages import worker_queue

SHARED = "inference"
A, B, C = (worker_queue(SHARED, f"inference-{i}@host") for i in (1, 2, 3))
BS = 4  # block size: a prompt of 4k tokens has k whole blocks
TTL = 4.0


def member(r, queue, *, held=0, capacity=64, now=100.0):
    m = RouteMember(r, queue, capacity=capacity, block_size=BS, ttl_s=TTL, held=lambda: held)
    m.report(now=now)
    return m


@pytest.fixture
def router(redis_client):
    return PrefixRouter(redis_client, load_factor=1.25, prefix_ttl_s=600, block_size=BS)


def prompt(system: int, question: int, blocks: int = 6) -> list[int]:
    """A prompt of a shared system part (``blocks - 1`` blocks named by ``system``) and a
    question block of its own."""
    return [system * 1000 + i for i in range((blocks - 1) * BS)] + [question * 10 + i for i in range(BS)]


def test_a_prompt_goes_where_its_prefix_went_and_a_new_prefix_to_its_hash_home(router, redis_client):
    member(redis_client, A)
    member(redis_client, B)
    first = router.place(SHARED, prompt(1, 1), now=100.5)
    assert first.outcome == ROUTED and first.match == "hash" and first.queue in (A, B) and first.live_workers == 2
    # the same system prompt with another question: its longest known prefix went there
    again = router.place(SHARED, prompt(1, 2), now=100.6)
    assert again == Placement(first.queue, ROUTED, "prefix", 2)
    # the hash home is stable: where a new prefix goes does not depend on who asks first
    other = PrefixRouter(redis_client, block_size=BS)
    assert other.place(SHARED, prompt(7, 1), now=100.7).queue == router.place(SHARED, prompt(7, 1), now=100.8).queue


def test_distinct_prefixes_spread_over_the_workers(router, redis_client):
    for q in (A, B, C):
        member(redis_client, q)
    homes = {router.place(SHARED, prompt(s, 0), now=100.5).queue for s in range(30)}
    assert homes == {A, B, C}


def test_each_routed_request_counts_until_the_worker_reports_what_it_really_holds(router, redis_client):
    member(redis_client, A)
    b = member(redis_client, B)
    p = router.place(SHARED, prompt(1, 1), now=100.5)
    assert int(redis_client.hget(LOAD_KEY, p.queue)) == 1
    b.report(now=100.6)
    member(redis_client, A, now=100.6)
    assert int(redis_client.hget(LOAD_KEY, A)) == 0 and int(redis_client.hget(LOAD_KEY, B)) == 0


def test_a_worker_above_its_share_is_skipped_and_the_prefix_follows_the_request(router, redis_client):
    member(redis_client, A)
    member(redis_client, B)
    home = router.place(SHARED, prompt(1, 1), now=100.5).queue
    away = B if home == A else A
    # the home holds 8, the other none: share = ceil(1.25 * (8 + 1) / 2) = 6 < 8 + 1
    member(redis_client, home, held=8, now=100.6)
    member(redis_client, away, held=0, now=100.6)
    spilled = router.place(SHARED, prompt(1, 2), now=100.7)
    assert spilled.outcome == SPILLED and spilled.queue == away and spilled.match == "hash"
    # the prefix went there last: the next request of it goes there, as routed
    member(redis_client, home, held=0, now=100.8)
    assert router.place(SHARED, prompt(1, 3), now=100.9) == Placement(away, ROUTED, "prefix", 2)


def test_within_its_share_a_busier_worker_keeps_its_prefix(router, redis_client):
    member(redis_client, A)
    member(redis_client, B)
    home = router.place(SHARED, prompt(1, 1), now=100.5).queue
    # 4 against 2: share = ceil(1.25 * 7 / 2) = 5 >= 4 + 1
    member(redis_client, home, held=4, now=100.6)
    member(redis_client, B if home == A else A, held=2, now=100.6)
    assert router.place(SHARED, prompt(1, 2), now=100.7).queue == home


def ring_order(tokens: list[int]) -> list[str]:
    """The workers in the rendezvous order of a prompt's first block, as the script ranks them."""
    first = block_hashes(tokens, BS)[0]
    return sorted((A, B, C), key=lambda w: hashlib.sha1((first + w).encode()).hexdigest(), reverse=True)


def test_a_shorter_remembered_prefix_on_another_worker_comes_before_the_hash_order(router, redis_client):
    long, short = prompt(1, 1, blocks=8), prompt(1, 1, blocks=3)  # the same first two blocks
    first, second, third = ring_order(long)
    assert ring_order(short) == [first, second, third]
    for q in (A, B, C):
        member(redis_client, q)
    assert router.place(SHARED, long, now=100.5).queue == first
    # its home and the next in the hash order are full: the short prompt goes to the third
    for q in (A, B, C):
        member(redis_client, q, held=0 if q == third else 30, now=100.6)
    assert router.place(SHARED, short, now=100.7) == Placement(third, SPILLED, "hash", 3)
    # the long prompt's home is still full; the worker where its two first blocks went last
    # comes before the hash order's next
    for q in (A, B, C):
        member(redis_client, q, held=30 if q == first else 0, now=100.8)
    assert router.place(SHARED, long, now=100.9) == Placement(third, SPILLED, "prefix", 3)


def test_a_full_worker_is_skipped_and_when_all_are_full_the_shared_queue_takes_it(router, redis_client):
    member(redis_client, A, held=2, capacity=2)
    member(redis_client, B, held=0, capacity=2)
    assert router.place(SHARED, prompt(1, 1), now=100.5).queue == B
    assert router.place(SHARED, prompt(2, 1), now=100.6).queue == B
    # B holds 2 now (routed): both are at their capacity
    assert router.place(SHARED, prompt(3, 1), now=100.7) == Placement(None, SPILLED, "none", 2)


def test_once_none_had_room_the_next_requests_wait_behind_in_the_shared_queue_until_it_drains(router, redis_client):
    member(redis_client, A, held=2, capacity=2)
    member(redis_client, B, held=1, capacity=2)
    assert router.place(SHARED, prompt(1, 1), now=100.5).queue == B
    assert router.place(SHARED, prompt(2, 1), now=100.6) == Placement(None, SPILLED, "none", 2)
    assert int(redis_client.hget(BACKLOG_KEY, SHARED)) == 1
    # A has room again, but a request waits in the shared queue: the next one joins it there,
    # where the workers take them in order, instead of overtaking it through A's own queue
    member(redis_client, A, held=0, capacity=2, now=100.7)
    assert router.place(SHARED, prompt(3, 1), now=100.8) == Placement(None, QUEUED, "none", 2)
    assert int(redis_client.hget(BACKLOG_KEY, SHARED)) == 2
    # a worker took them: its report sets the backlog to what waits there, none
    RouteMember(redis_client, A, capacity=2, block_size=BS, ttl_s=TTL, held=lambda: 2, shared=SHARED,
                shared_keys=queue_keys(SHARED, Lane.INTERACTIVE)).report(now=100.9)
    assert int(redis_client.hget(BACKLOG_KEY, SHARED)) == 0
    member(redis_client, A, held=0, capacity=2, now=101.0)
    member(redis_client, B, held=0, capacity=2, now=101.0)
    assert router.place(SHARED, prompt(4, 1), now=101.1).outcome == ROUTED


def test_a_backlog_of_another_model_does_not_hold_this_ones_routing(router, redis_client):
    member(redis_client, A)
    member(redis_client, B)
    redis_client.hset(BACKLOG_KEY, "inference.other", 5)
    assert router.place(SHARED, prompt(1, 1), now=100.5).outcome == ROUTED


def test_a_dead_worker_is_never_chosen_and_its_prefixes_move_to_the_living(router, redis_client):
    member(redis_client, A)
    member(redis_client, B)
    home = router.place(SHARED, prompt(1, 1), now=100.5).queue
    living = B if home == A else A
    member(redis_client, living, now=103.0)  # the home's last report was at 100.0: gone at 104.0
    p = router.place(SHARED, prompt(1, 2), now=104.5)
    # the only live worker: fewer than two, not routed
    assert p.outcome == SINGLE and p.queue is None
    member(redis_client, C, now=104.5)
    p = router.place(SHARED, prompt(1, 3), now=105.7)
    assert p.queue in (living, C) and p.outcome == ROUTED and p.live_workers == 2


def test_with_one_worker_nothing_is_routed_and_redis_is_asked_once_a_recheck(redis_client):
    router = PrefixRouter(redis_client, block_size=BS, recheck_s=1.0)
    member(redis_client, A)
    assert router.place(SHARED, prompt(1, 1), now=100.1) == Placement(None, SINGLE, live_workers=1)
    assert router.place(SHARED, prompt(1, 1), now=100.2) == Placement(None, SINGLE)  # from the recheck
    member(redis_client, B, now=100.3)
    assert router.place(SHARED, prompt(1, 1), now=100.9).outcome == SINGLE  # not asked again yet
    assert router.place(SHARED, prompt(1, 1), now=101.2).outcome == ROUTED


def test_other_models_workers_do_not_count(router, redis_client):
    member(redis_client, A)
    member(redis_client, worker_queue("inference.other", "w@h"))
    assert router.place(SHARED, prompt(1, 1), now=100.5).outcome == SINGLE


def test_a_prompt_shorter_than_a_block_takes_the_shared_queue(router, redis_client):
    member(redis_client, A)
    member(redis_client, B)
    assert router.place(SHARED, prompt(1, 1), now=100.5).outcome == ROUTED
    assert router.place(SHARED, [1, 2, 3], now=100.6) == Placement(None, FALLBACK, "none", 2)


def test_the_block_size_is_the_workers_own_until_a_setting_says_otherwise(redis_client):
    router = PrefixRouter(redis_client)
    assert router.block_size_of(SHARED) == DEFAULT_BLOCK_SIZE
    member(redis_client, A)
    member(redis_client, B)
    router.place(SHARED, list(range(64)), now=100.5)
    assert router.block_size_of(SHARED) == BS
    assert PrefixRouter(redis_client, block_size=32).block_size_of(SHARED) == 32


def test_where_a_prefix_went_is_remembered_for_the_ttl(redis_client):
    router = PrefixRouter(redis_client, block_size=BS, prefix_ttl_s=30)
    member(redis_client, A)
    member(redis_client, B)
    router.place(SHARED, prompt(1, 1), now=100.5)
    ttls = [redis_client.ttl(k) for k in redis_client.scan_iter(match=prefix_key(SHARED, "*"))]
    assert len(ttls) == 6 and all(0 < t <= 30 for t in ttls)


def test_an_unreachable_redis_is_a_fallback_never_an_error():
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    assert PrefixRouter(dead, block_size=BS).place(SHARED, prompt(1, 1)).outcome == FALLBACK


def test_the_load_factor_is_at_least_one(redis_client):
    with pytest.raises(ValueError):
        PrefixRouter(redis_client, load_factor=0.9)
