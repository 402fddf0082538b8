"""Build-once-into-place helpers shared by the model builders.

A model folder is built in a temporary sibling folder, finished with a marker file
(written last), and renamed into place. A lock file next to it serialises builders in
several processes (test workers, celery workers), so only one of them does the work and
the others find a complete folder when they get the lock.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

MARKER = ".llmpipe-complete"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def recipe_key(*parts: str | bytes) -> str:
    """A short hash that names one recipe: its inputs, its code, the library versions."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def is_complete(dest: Path, key: str) -> bool:
    """True when ``dest`` holds a finished build of recipe ``key`` with all its files."""
    marker = dest / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("recipe") != key:
        return False
    files = info.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        try:
            if (dest / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _write_marker(folder: Path, key: str) -> None:
    files = {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }
    text = json.dumps({"recipe": key, "files": files}, indent=2, sort_keys=True) + "\n"
    (folder / MARKER).write_text(text)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX; the rename alone keeps it safe
        yield
        return
    with path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_once(dest: Path, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Make ``dest`` a complete build of recipe ``key``; returns (absolute dest, built now).

    ``build(tmp)`` writes the model files into the empty folder ``tmp``. It runs only when
    ``dest`` is not already complete for this recipe. An old or broken ``dest`` is replaced.
    """
    dest = Path(dest).expanduser().absolute()
    if is_complete(dest, key):
        return dest, False
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _lock(dest.parent / f".{dest.name}.lock"):
        if is_complete(dest, key):  # another process finished it while we waited
            return dest, False
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            build(tmp)
            _write_marker(tmp, key)
            if dest.exists() or dest.is_symlink():
                old = dest.parent / f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                os.rename(dest, old)
                os.rename(tmp, dest)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest, True


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' tqdm bars and warnings for the duration (restored after)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # The GGUF reader uses a plain tqdm bar that the switch above does not reach.
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - gguf support moved or missing
        gguf_utils = None
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _rewrite_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def portable_files(folder: Path, dtype: str) -> None:
    """Make a folder saved by transformers 5 readable by older readers too, deterministically.

    transformers 5 writes ``dtype``, ``rope_parameters``, ``extra_special_tokens`` and a
    ``TokenizersBackend`` class; transformers 4.x and some vLLM versions read
    ``torch_dtype``, ``rope_theta``, ``additional_special_tokens``, ``PreTrainedTokenizerFast``
    and a ``chat_template`` inside tokenizer_config.json. Both spellings are written; both
    loaders read the files the same way. Files are also made world-readable.
    """

    def config(cfg: dict) -> None:
        cfg.pop("quantization_config", None)
        cfg.pop("_model_name_or_path", None)
        cfg["dtype"] = dtype
        cfg["torch_dtype"] = dtype
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict) and rope.get("rope_type", "default") == "default":
            if "rope_theta" in rope:
                cfg["rope_theta"] = rope["rope_theta"]

    def tokenizer_config(tc: dict) -> None:
        if tc.get("tokenizer_class") in (None, "TokenizersBackend"):
            tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        extra = tc.get("extra_special_tokens")
        if isinstance(extra, list):
            tc["additional_special_tokens"] = tc.pop("extra_special_tokens")
        for junk in ("is_local", "local_files_only", "name_or_path"):  # load-time leftovers
            tc.pop(junk, None)
        template = folder / "chat_template.jinja"
        if template.is_file() and "chat_template" not in tc:
            tc["chat_template"] = template.read_text()

    if (folder / "config.json").is_file():
        _rewrite_json(folder / "config.json", config)
    if (folder / "tokenizer_config.json").is_file():
        _rewrite_json(folder / "tokenizer_config.json", tokenizer_config)
    for p in folder.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
