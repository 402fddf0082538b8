"""The load generator lends each request in flight a client of its own (llmpipe/bench/loadgen.py)."""

import asyncio

from llmpipe.bench.loadgen import run_load


class HoldsItsClient:
    """Checks that no two requests in flight share a client, and yields once while holding it."""

    protocol = "fake"

    def __init__(self, takes_s: float = 0.0):
        self.takes_s = takes_s  # how long a request lasts, so that arrivals overlap
        self.in_flight: set = set()
        self.seen: set = set()

    async def request(self, http, s, prompt):
        assert http not in self.in_flight, "two requests in flight on one client"
        self.in_flight.add(http)
        self.seen.add(http)
        await asyncio.sleep(self.takes_s)  # the other users run while this one holds its client
        self.in_flight.discard(http)
        s.ok = True


def test_closed_loop_has_a_client_per_user_reused_and_closed():
    fake = HoldsItsClient()
    samples = asyncio.run(run_load(fake, ["p"], requests=40, concurrency=4))
    assert len(samples) == 40 and all(s.ok for s in samples), [s.error for s in samples if not s.ok]
    assert len(fake.seen) == 4  # one per user, kept for its next request
    assert all(http.is_closed for http in fake.seen)


def test_open_loop_lends_free_clients_again():
    fake = HoldsItsClient(takes_s=0.02)  # ~6 in flight at 300 req/s
    samples = asyncio.run(run_load(fake, ["p"], requests=30, rate=300.0))
    assert all(s.ok for s in samples), [s.error for s in samples if not s.ok]
    assert 2 <= len(fake.seen) < 30  # as many as were in flight at once, then lent again
    assert all(http.is_closed for http in fake.seen)
