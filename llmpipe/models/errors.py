"""Errors raised while preparing a model folder."""

from __future__ import annotations


class ModelPreparationError(Exception):
    """A model could not be found, built or converted; the message is one line."""
