import pytest

from llmpipe.errors import EngineDeadError, EngineError
from llmpipe.processors.isolation import run_isolated


def _engine(poison=(), transient_failures=None, calls=None):
    """A fake engine: fails any batch that holds a poison item."""
    transient_failures = transient_failures if transient_failures is not None else {}

    def generate(batch):
        if calls is not None:
            calls.append(list(batch))
        if any(x in poison for x in batch):
            raise EngineError("poison in batch")
        for x in batch:
            if transient_failures.get(x, 0) > 0:
                transient_failures[x] -= 1
                raise EngineError("out of memory", transient=True)
        return [x * 2 for x in batch]

    return generate


def test_poison_request_fails_alone_others_succeed():
    calls = []
    out = run_isolated(_engine(poison={5}, calls=calls), list(range(8)))
    assert [o for i, o in enumerate(out) if i != 5] == [i * 2 for i in range(8) if i != 5]
    assert isinstance(out[5], EngineError)
    # splitting is logarithmic: never more than 2*log2(n)+1 engine calls per poison
    assert len(calls) <= 1 + 2 * 3 + 1


def test_transient_error_is_retried_with_backoff():
    slept = []
    out = run_isolated(_engine(transient_failures={1: 2}), [1], attempts=3, backoff_s=0.01, sleep=slept.append)
    assert out == [2]
    assert len(slept) == 1  # first failure in run_isolated, then 2 tries: 1 wait between them


def test_transient_error_that_keeps_failing_gives_error():
    out = run_isolated(_engine(transient_failures={1: 99}), [1], attempts=3, sleep=lambda s: None)
    assert isinstance(out[0], EngineError) and out[0].transient


def test_dead_engine_propagates():
    def generate(batch):
        raise EngineDeadError("engine core died")

    with pytest.raises(EngineDeadError):
        run_isolated(generate, [1, 2, 3])


def test_empty_batch():
    assert run_isolated(_engine(), []) == []
