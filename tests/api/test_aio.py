"""api/aio.py: a deadline that never swallows the waiting task's cancel."""

from __future__ import annotations

import asyncio

import pytest

from api.aio import within


def test_the_awaited_finishing_in_time_is_true_and_running_out_is_false():
    async def main():
        ev = asyncio.Event()
        asyncio.get_running_loop().call_soon(ev.set)
        return await within(ev.wait(), 5), await within(asyncio.Event().wait(), 0.01)

    assert asyncio.run(main()) == (True, False)


def test_a_cancel_that_lands_as_the_event_is_set_is_not_lost():
    # asyncio.wait_for on Python 3.11 returns here as if nothing happened (bpo-42130): a batch
    # feeder that cancelled its line tasks then waited on them forever.
    async def main():
        ev = asyncio.Event()
        task = asyncio.create_task(within(ev.wait(), 10))
        await asyncio.sleep(0)  # the task waits on the event
        ev.set()  # its wait completes ...
        task.cancel()  # ... and the cancel lands in the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
