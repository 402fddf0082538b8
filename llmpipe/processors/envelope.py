"""What every stage does around its own work: deadline check, error pass-through, timing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from llmpipe.errors import ExpiredError, LlmpipeError
from llmpipe.messages import Stage, StageError, StageTiming, _Envelope

In = TypeVar("In", bound=_Envelope)
Out = TypeVar("Out", bound=_Envelope)

WallClock = Callable[[], float]


def expired_error(msg: _Envelope, stage: Stage, now: float) -> StageError | None:
    if now >= msg.deadline:
        late = now - msg.deadline
        return ExpiredError(f"job deadline passed {late:.3f}s before the {stage} stage could start").to_stage_error(stage)
    return None


def run_stage(
    stage: Stage,
    msg: In,
    work: Callable[[In], Out],
    failed: Callable[[In, StageError], Out],
    clock: WallClock = time.time,
) -> Out:
    """Run ``work`` unless the message already failed or expired; stamp the timing.

    ``failed`` builds the outgoing message for a request that will not be worked on, so
    that the error travels on to the chord and the job's other prompts still finish.
    """
    started = clock()
    error = msg.error or expired_error(msg, stage, started)
    if error is not None:
        out = failed(msg, error)
    else:
        try:
            out = work(msg)
        except LlmpipeError as exc:
            out = failed(msg, exc.to_stage_error(stage))
    finished = clock()
    out.timings = [*msg.timings, StageTiming(stage=stage, enqueued_at=msg.enqueued_at, started_at=started, finished_at=finished)]
    out.enqueued_at = finished
    return out


def as_json(msg: BaseModel) -> dict:
    """A stage's outgoing message as it travels (JSON): absent fields (logprobs, echo...) stay out."""
    return msg.model_dump(mode="json", exclude_none=True)
