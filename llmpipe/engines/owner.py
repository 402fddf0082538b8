"""One engine per process, loaded on first use."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from llmpipe.engines.base import Engine
from llmpipe.errors import EngineDeadError

log = logging.getLogger(__name__)


class EngineOwner:
    """Loads the engine lazily, once, on the first ``get()``.

    Thread-safe: concurrent callers wait for the one load in progress and get its engine,
    or its exception (the same exception object) when it fails; the next ``get()`` after
    a failure tries again. ``shutdown()`` shuts the engine down once and is idempotent;
    ``get()`` after it raises EngineDeadError.
    """

    def __init__(self, factory: Callable[[], Engine]) -> None:
        self._factory = factory
        self._engine: Engine | None = None
        self._loading: Future[Engine] | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def get(self) -> Engine:
        engine = self._engine
        if engine is not None:
            return engine
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine is shut down")
            if self._engine is not None:
                return self._engine
            loading = self._loading
            if loading is None:
                loading = self._loading = Future()
                loader = True
            else:
                loader = False
        if not loader:
            return loading.result()  # raises the loader's exception
        try:
            engine = self._factory()
        except BaseException as e:
            with self._lock:
                self._loading = None  # the next get() retries
            loading.set_exception(e)
            raise
        with self._lock:
            self._loading = None
            closed = self._closed
            if not closed:
                self._engine = engine
        if closed:  # shut down while loading: do not leak the engine
            engine.shutdown()
            err = EngineDeadError("the engine is shut down")
            loading.set_exception(err)
            raise err
        loading.set_result(engine)
        return engine

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engine, self._engine = self._engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                log.exception("engine shutdown failed")
