"""Celery tasks, thin like web views: each hands its message to its stage's body in
llmpipe/processors/ (through the worker's context, ``self.ctx``). ``celery -A tasks worker``."""

from llmpipe.celery_app import app

__all__ = ["app"]
