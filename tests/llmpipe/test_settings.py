"""One typed settings object: flags > environment (LLMPIPE_*) > config file > defaults,
and `llmpipe up --config FILE` feeds the same chain."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llmpipe.settings import ConfigFileError, EngineKind, Settings

FIELDS = ("model", "engine", "api_port", "cpu_workers", "redis_url", "flower_port", "state_dir", "batch_window_ms")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("LLMPIPE_CONFIG", raising=False)
    for name in FIELDS:
        monkeypatch.delenv(f"LLMPIPE_{name.upper()}", raising=False)


def _toml(tmp_path, text: str):
    path = tmp_path / "llmpipe.toml"
    path.write_text(text)
    return path


def test_defaults():
    s = Settings()
    assert (s.model, s.engine, s.api_port, s.cpu_workers) == ("smollm2", EngineKind.VLLM, 8000, 2)
    assert "redis_url" not in s.model_fields_set


def test_flags_beat_env_beat_file(tmp_path, monkeypatch):
    cfg = _toml(tmp_path, 'model = "from-file"\napi_port = 7001\ncpu_workers = 3\nengine = "transformers"\n')
    monkeypatch.setenv("LLMPIPE_CONFIG", str(cfg))
    monkeypatch.setenv("LLMPIPE_MODEL", "from-env")
    monkeypatch.setenv("LLMPIPE_API_PORT", "7002")
    s = Settings(model="from-flag")
    assert s.model == "from-flag"  # flag over env and file
    assert s.api_port == 7002  # env over file
    assert s.cpu_workers == 3 and s.engine is EngineKind.TRANSFORMERS  # file over defaults
    assert s.batch_window_ms == 50.0  # default


def test_file_under_llmpipe_table_and_json(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMPIPE_CONFIG", str(_toml(tmp_path, "[llmpipe]\nmax_batch_size = 8\n")))
    assert Settings().max_batch_size == 8
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"max_batch_size": 4, "redis_url": "redis://example:1/0"}))
    monkeypatch.setenv("LLMPIPE_CONFIG", str(path))
    s = Settings()
    assert s.max_batch_size == 4 and s.redis_url == "redis://example:1/0"
    assert "redis_url" in s.model_fields_set  # configured, not a default


@pytest.mark.parametrize("content, suffix, message", [
    (None, ".toml", "No such file"),
    ("api_port = ", ".toml", "not valid TOML"),
    ("{", ".json", "not valid JSON"),
    ("[1, 2]", ".json", "table of settings"),
])
def test_bad_config_file_is_one_clear_error(tmp_path, monkeypatch, content, suffix, message):
    path = tmp_path / f"cfg{suffix}"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("LLMPIPE_CONFIG", str(path))
    with pytest.raises(ConfigFileError, match=message):
        Settings()


@pytest.fixture
def captured(monkeypatch):
    """`llmpipe up` with run_up replaced: what settings it would run with."""
    calls = []

    def fake_run_up(s, **kw):
        calls.append((s, kw))
        return 0

    monkeypatch.setattr("llmpipe.local.up.run_up", fake_run_up)
    monkeypatch.setenv("LLMPIPE_CONFIG", "")  # restored after the test; --config sets it
    return calls


def test_up_flags_env_and_config_file(tmp_path, monkeypatch, captured):
    from llmpipe.cli import main

    cfg = _toml(tmp_path, 'model = "from-file"\napi_port = 7001\ncpu_workers = 3\n')
    monkeypatch.setenv("LLMPIPE_CPU_WORKERS", "5")
    result = CliRunner().invoke(main, ["up", "--config", str(cfg), "--port", "7100", "--no-flower",
                                       "--redis-url", "embedded", "--batch-window-ms", "20"])
    assert result.exit_code == 0, result.output
    (s, kw), = captured
    assert (s.model, s.api_port, s.cpu_workers, s.batch_window_ms) == ("from-file", 7100, 5, 20.0)
    assert s.redis_url == "embedded" and kw["redis_explicit"] is True and kw["flower"] is False


def test_up_redis_explicit_only_when_configured(tmp_path, monkeypatch, captured):
    from llmpipe.cli import main

    assert CliRunner().invoke(main, ["up"]).exit_code == 0
    monkeypatch.setenv("LLMPIPE_REDIS_URL", "redis://127.0.0.1:1/0")
    assert CliRunner().invoke(main, ["up"]).exit_code == 0
    assert [kw["redis_explicit"] for _, kw in captured] == [False, True]


def test_up_bad_setting_is_one_line(tmp_path, monkeypatch, captured):
    from llmpipe.cli import main

    monkeypatch.setenv("LLMPIPE_API_PORT", "not-a-port")
    result = CliRunner().invoke(main, ["up"])
    assert result.exit_code != 0 and not captured
    assert "invalid setting api_port='not-a-port'" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
