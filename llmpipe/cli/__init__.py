"""The ``llmpipe`` command: ``commands`` (serving, workers, models), ``client`` (submit, chat,
cancel) and ``vllm`` (vLLM's own CLI in this venv)."""

from llmpipe.cli.commands import main

__all__ = ["main"]
