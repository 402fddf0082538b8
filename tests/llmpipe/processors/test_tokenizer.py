"""llmpipe/processors/tokenizer.py: the CPU stages' tokenizer is the one AutoTokenizer
builds, loaded without importing torch when the model names the fast tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmpipe.processors.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]

TEXTS = ["hello world", "  leading spaces and\ttabs\n\nnewlines", "Ünïcödé → 東京 🙂", "<|im_start|>user",
         "The capital of France is", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def assert_same_tokenizer(ours, auto) -> None:
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"], text
        assert ours.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    assert ours.all_special_ids == auto.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                          auto.pad_token_id)
    if auto.chat_template:
        for gen in (True, False):
            assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
                    == auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen))


def test_the_fast_tokenizer_is_the_one_autotokenizer_builds(tiny_model):
    from transformers import AutoTokenizer

    assert_same_tokenizer(load_tokenizer(tiny_model), AutoTokenizer.from_pretrained(tiny_model))


def test_loading_it_imports_no_torch(tiny_model):
    code = ("import sys; from llmpipe.processors.tokenizer import load_tokenizer; "
            f"tok = load_tokenizer({tiny_model!r}); assert tok('hi')['input_ids']; "
            "print(sorted(m for m in ('torch', 'transformers.configuration_utils', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("cls", ["LlamaTokenizerFast", None])
def test_any_other_class_goes_through_autotokenizer(tiny_model, tmp_path, cls):
    # A model-specific class (or none named) may change how text is split: AutoTokenizer decides.
    from transformers import AutoTokenizer

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model) / f, tmp_path / f)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if cls is None:
        cfg.pop("tokenizer_class")
    else:
        cfg["tokenizer_class"] = cls
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))

    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert_same_tokenizer(load_tokenizer(str(tmp_path)), auto)
