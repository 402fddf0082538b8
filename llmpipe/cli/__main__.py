"""``python -m llmpipe.cli``: the ``llmpipe`` command."""

from llmpipe.cli.commands import main

main()
