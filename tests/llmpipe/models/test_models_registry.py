"""resolve_model and context_length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmpipe.models import ModelPreparationError, context_length, resolve_model


def test_tiny_is_built_under_models_dir(tmp_path):
    models = tmp_path / "models"
    path = resolve_model("tiny", models)
    assert path == str((models / "tiny").absolute())
    assert (Path(path) / "model.safetensors").is_file()
    assert context_length(path) == 2048
    # Resolving again reuses it.
    mtime = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny", models) == path
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("name", ["./no-such-model", "/no/such/model", "~/no-such-model-llmpipe", "../x", "a/b/c"])
def test_missing_path_is_an_error(tmp_path, name):
    with pytest.raises(ModelPreparationError) as e:
        resolve_model(name, tmp_path)
    assert str(e.value) == f"model path {name} does not exist"
    assert list(tmp_path.iterdir()) == []


def test_a_file_is_not_a_model_folder(tmp_path):
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"x")
    with pytest.raises(ModelPreparationError, match="not a folder"):
        resolve_model(str(f), tmp_path / "models")


def test_empty_name_is_an_error(tmp_path):
    with pytest.raises(ModelPreparationError):
        resolve_model("  ", tmp_path)


def test_existing_folder_resolves_to_its_absolute_path(tmp_path, monkeypatch):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert resolve_model(str(folder), tmp_path / "models") == str(folder)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my-model", tmp_path / "models") == str(folder)
    assert resolve_model("./my-model", tmp_path / "models") == str(folder)
    assert context_length(resolve_model("my-model", tmp_path / "models")) == 4096


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "meta-llama/Llama-3.2-1B"])
def test_hub_ids_pass_through(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert resolve_model(name, tmp_path / "models") == name
    assert not (tmp_path / "models").exists()
    assert context_length(name) is None


def test_context_length_variants(tmp_path):
    def folder(name: str, cfg) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    assert context_length(tmp_path / "nowhere") is None
    assert context_length(folder("none", {"model_type": "llama"})) is None
    assert context_length(folder("nested", {"text_config": {"max_position_embeddings": 32768}})) == 32768
    assert context_length(folder("gpt2", {"n_positions": 1024})) == 1024
    assert context_length(folder("bad", {"max_position_embeddings": "lots"})) is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert context_length(broken) is None
