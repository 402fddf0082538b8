"""Celery tasks: thin wrappers over llmpipe.processors. ``celery -A tasks worker``."""

from llmpipe.celery_app import app

__all__ = ["app"]
