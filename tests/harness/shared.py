"""Stacks shared across modules, as Ray Serve's ``serve_instance`` and Celery's
``celery_session_worker`` fixtures share one per session.

A fixture that lends a shared stack is marked with ``@lends(key_of)``; ``key_of(params)``
names the stack it needs from the test's parameters (its ``callspec.params``). After
collection the plugin (tests/harness/plugin.py) notes the last test of the run that needs
each key; the ``shared_stacks`` pool starts a stack for the first module that asks for its
key and stops it right after that last test (or at the session's end). Modules that ask for
the same key get the same stack, reset in between by the stack's own ``lend``.

Only stacks that no test hurts are shared: a module that kills, stops or overloads a stack
keeps its own (tests/harness/stacks.py start_pipeline, tests/harness/pipe.py start_pipe).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

LENDS = "_llmpipe_lends"


def lends(key_of: Callable[[dict], Hashable | None]):
    """Marks a fixture function as lending the shared stack ``key_of(params)`` names."""
    def mark(fn):
        setattr(fn, LENDS, key_of)
        return fn

    return mark


def keys_of(item) -> set[Hashable]:
    """The shared stacks a collected test needs (through any fixture it uses)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    keys = set()
    for defs in getattr(item, "_fixtureinfo").name2fixturedefs.values():
        key_of = getattr(defs[-1].func, LENDS, None) if defs else None
        key = key_of(params) if key_of else None
        if key is not None:
            keys.add(key)
    return keys


def last_users(items: Iterable) -> dict[Hashable, str]:
    """Each shared stack's key -> the node id of the last test that needs it."""
    last: dict[Hashable, str] = {}
    for item in items:
        for key in keys_of(item):
            last[key] = item.nodeid
    return last


class StackPool:
    """The session's shared stacks: ``get`` starts one on first use, ``done_with`` stops
    those whose last test just ran, ``close`` stops every one left."""

    def __init__(self):
        self._stacks: dict[Hashable, tuple[Any, Callable[[Any], None]]] = {}
        self.last: dict[Hashable, str] = {}  # set by the plugin after collection

    def get(self, key: Hashable, start: Callable[[], Any], stop: Callable[[Any], None]) -> Any:
        """The stack ``key`` names, started with ``start()`` if it is not running."""
        if key not in self._stacks:
            self._stacks[key] = (start(), stop)
        return self._stacks[key][0]

    def done_with(self, nodeid: str) -> None:
        """Stops the stacks whose last test was ``nodeid``."""
        for key in [k for k, last in self.last.items() if last == nodeid]:
            self._stop(key)

    def _stop(self, key: Hashable) -> None:
        entry = self._stacks.pop(key, None)
        if entry is not None:
            stack, stop = entry
            stop(stack)

    def close(self) -> None:
        for key in list(self._stacks):
            self._stop(key)


POOL = StackPool()  # one per pytest process (each pytest-xdist worker has its own)
