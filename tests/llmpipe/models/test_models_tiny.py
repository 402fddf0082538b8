"""The tiny test model: byte-identical builds, build-once behaviour, tokenizer, chat template."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmpipe.models import build_tiny
from llmpipe.models._build import MARKER
from llmpipe.models.tiny import BOS, EOS, IM_END, IM_START, PAD

REPO = Path(__file__).resolve().parents[3]


def file_hashes(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny-a") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_build_writes_a_complete_model_folder(tiny_dir):
    names = set(file_hashes(tiny_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", MARKER} <= names
    assert not any(n.endswith(".bin") for n in names)
    # No temporary or old folders are left next to it.
    assert sorted(p.name for p in tiny_dir.parent.iterdir() if p.is_dir()) == ["tiny"]


def test_two_builds_are_byte_identical_and_leave_the_callers_rng_alone(tiny_dir, tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    other = build_tiny(tmp_path / "tiny")
    assert torch.equal(torch.rand(3), expected)
    assert other != tiny_dir
    assert file_hashes(other) == file_hashes(tiny_dir)


def test_config_is_what_vllm_needs(tiny_dir, tokenizer):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert cfg["vocab_size"] == len(tokenizer)
    assert 2000 <= cfg["vocab_size"] <= 4096
    assert cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] == 2048
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (256, 4, 4)
    assert "quantization_config" not in cfg
    assert cfg["bos_token_id"] == tokenizer.bos_token_id
    assert cfg["eos_token_id"] == tokenizer.eos_token_id
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == tokenizer.convert_tokens_to_ids(BOS)
    assert gen["pad_token_id"] == tokenizer.convert_tokens_to_ids(PAD)
    assert gen["eos_token_id"] == [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)]


def test_tokenizer_special_tokens(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS, EOS, PAD)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD, IM_START, IM_END)]
    assert ids == [0, 1, 2, 3, 4]
    assert tokenizer.model_max_length == 2048
    # A special token in text is one token, and nothing is added around plain text.
    assert tokenizer("<|im_start|>user").input_ids[0] == 3
    assert 0 not in tokenizer("hello").input_ids


@pytest.mark.parametrize(
    "text",
    [
        "What is the capital of France? Paris.",
        "  leading spaces, tabs\tand\nnew lines\n\n",
        "Unicode: café, naïve, Ünïcödé, 日本語, emoji 🙂, math ∑ x² ≤ 3.14",
        "def add(a, b):\n    return a + b\n",
        "",
    ],
)
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_learned_english(tokenizer):
    # Byte-level BPE trained on the corpus: common words are single tokens, prose compresses.
    for word in (" Paris", " France", " capital", " the"):
        assert len(tokenizer(word).input_ids) == 1, word
    text = "The capital of France is Paris, and the river Seine runs through the city."
    assert len(text.encode()) / len(tokenizer(text).input_ids) > 3.0


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    body = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == body
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_prompt == body + "<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == tokenizer(with_prompt).input_ids
    assert ids.count(3) == 3 and ids.count(4) == 2


def test_model_loads_and_generates_deterministically(tiny_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**ids).logits
        assert logits.shape == (1, ids["input_ids"].shape[1], len(tokenizer))
        assert torch.isfinite(logits).all()
        a = model.generate(**ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        b = model.generate(**ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert a.shape[1] == ids["input_ids"].shape[1] + 6
    assert torch.equal(a, b)


def test_complete_build_is_not_redone(tiny_dir):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    t0 = time.perf_counter()
    assert build_tiny(tiny_dir) == tiny_dir
    assert time.perf_counter() - t0 < 2.0
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before


def test_broken_or_stale_build_is_replaced(tiny_dir, tmp_path):
    expected = file_hashes(tiny_dir)
    for damage in ("truncated", "stale"):
        dest = tmp_path / damage
        dest.mkdir()
        for name in expected:
            (dest / name).write_bytes((tiny_dir / name).read_bytes())
        if damage == "truncated":
            (dest / "model.safetensors").write_bytes(b"partial")
        else:
            marker = json.loads((dest / MARKER).read_text())
            marker["recipe"] = "an-older-recipe"
            (dest / MARKER).write_text(json.dumps(marker))
        assert build_tiny(dest) == dest
        assert file_hashes(dest) == expected, damage


def test_concurrent_builders_share_one_build(tiny_dir, tmp_path):
    dest = tmp_path / "shared" / "tiny"
    code = "import sys; from pathlib import Path; from llmpipe.models import build_tiny; print(build_tiny(Path(sys.argv[1])))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(dest)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == str(dest)
    assert file_hashes(dest) == file_hashes(tiny_dir)
    # Only the model folder and the lock file remain: no temporary folders.
    assert sorted(p.name for p in dest.parent.iterdir()) == [".tiny.lock", "tiny"]
