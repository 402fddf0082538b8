"""The one typed settings object for llmpipe.

Precedence: explicit overrides (CLI flags) > environment (``LLMPIPE_*``) > an optional
config file named by ``LLMPIPE_CONFIG`` (TOML or JSON; ``llmpipe up --config FILE`` sets
it) > defaults. In the file, keys are the field names (``api_port = 8001``), at the top
level or under an ``[llmpipe]`` table.
"""

from __future__ import annotations

import json
import os
import tomllib
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class EngineKind(StrEnum):
    VLLM = "vllm"
    TRANSFORMERS = "transformers"
    # Benchmark-only engines; never a default.
    NOOP = "noop"
    SIMULATED = "simulated"


def _state_dir_default() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "llmpipe"


class ConfigFileError(ValueError):
    """The config file named by LLMPIPE_CONFIG cannot be read."""


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Reads the file named by LLMPIPE_CONFIG; lowest priority above defaults."""

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by pydantic here
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("LLMPIPE_CONFIG")
        if not path:
            return {}
        p = Path(path).expanduser()
        try:
            text = p.read_text()
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except OSError as exc:
            raise ConfigFileError(f"config file {path} (LLMPIPE_CONFIG): {exc.strerror or exc}") from None
        except ValueError as exc:  # JSONDecodeError and TOMLDecodeError both are
            raise ConfigFileError(f"config file {path} (LLMPIPE_CONFIG) is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("llmpipe", data), dict):
            raise ConfigFileError(f"config file {path} (LLMPIPE_CONFIG) must hold a table of settings")
        return data.get("llmpipe", data)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLMPIPE_", extra="ignore")

    # Infrastructure
    redis_url: str = "redis://127.0.0.1:6379/0"
    state_dir: Path = Field(default_factory=_state_dir_default)

    # Model and engine
    model: str = "smollm2"  # "smollm2", "tiny", a local folder, or a hub id
    engine: EngineKind = EngineKind.VLLM
    # None: chosen by platform (llmpipe/engines/platform.py): on CUDA dtype auto (bf16 for
    # the transformers engine), CUDA graphs, 0.9 of the GPU, vLLM's own max_num_seqs; on the
    # CPU float32, eager, 0.85, max_num_seqs = max_batch_size.
    dtype: str | None = None
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_gib: float = 1.0  # vLLM CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)
    enforce_eager: bool | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None  # vLLM's running set (continuous batching); not the dispatch batch
    # The most log probabilities a request may ask per token (vLLM's --max-logprobs; an
    # engine argument max_logprobs folds into it, so the API and vLLM agree).
    max_logprobs: int = 20
    # Other vLLM AsyncEngineArgs, passed through (`--engine-arg KEY=VALUE`, `[engine_args]` in
    # the config file); checked against vLLM's fields (llmpipe/engines/vllm_args.py). Those
    # that are settings above fold into them.
    engine_args: dict[str, Any] = Field(default_factory=dict)

    # Dynamic batching on the inference worker
    batch_window_ms: float = 50.0
    max_batch_size: int = 32

    # Limits on a request
    max_prompts_per_job: int = 64
    max_tokens_limit: int = 4096
    max_n: int = 8
    max_prompt_chars: int = 200_000
    max_body_bytes: int = 1_000_000
    default_max_tokens: int = 64

    # Deadlines and retention
    default_timeout_s: float = 120.0
    max_timeout_s: float = 600.0
    result_ttl_s: int = 24 * 3600

    # Admission control (0 disables a limit)
    max_queue_depth: int = 1000
    max_queued_prompt_tokens: int = 2_000_000

    # Pools
    cpu_workers: int = 2
    api_port: int = 8000
    flower_port: int = 5555
    flower_user: str = "admin"
    flower_password: str = ""
    api_keys: str = ""  # comma-separated bearer keys; empty disables auth

    # SIMULATED engine (benchmarks only): the GPU cost model, see llmpipe/engines/simulated.py.
    # Defaults: ~346 ms of "GPU" time for one 512-token prompt with 64 output tokens.
    sim_prefill_ms_per_token: float = 0.1
    sim_step_ms: float = 4.6  # one decode step of a batch of one
    sim_step_ms_per_seq: float = 0.15  # added to a step per extra sequence in the batch
    # Simulated CPU work (busy loop, CPU time) per prompt in the pre/post stages; 0: none.
    # Benchmarks only (`llmpipe bench --engine simulated`); never set in production.
    sim_preprocess_cpu_ms: float = 0.0
    sim_postprocess_cpu_ms: float = 0.0

    # Reliability (docs/reliability.md)
    # An unacked message (its worker died) is redelivered after this long; None: max_timeout_s
    # + 60, so that a slow but healthy task is never run twice. Tests shorten it.
    visibility_timeout_s: float | None = None
    unacked_restore_interval_s: float = 10.0  # how often workers sweep for such messages
    max_deliveries: int = 3  # an inference request delivered more often (it kills its worker) is dead-lettered
    deadletter_ttl_s: int = 7 * 24 * 3600
    deadletter_max_entries: int = 10_000
    # The deadline watchdog (llmpipe/watchdog.py) in postprocess/collect workers; 0 disables it.
    watchdog_interval_s: float = 2.0
    watchdog_grace_s: float = 5.0  # how long after its deadline an unfinished job is settled
    # Task events feed Flower; off, Flower shows nothing but each task costs less CPU and Redis.
    task_events: bool = True

    # Logs (docs/architecture.md, "Logs"). No prompt or generated content is logged unless
    # this is on (debugging only): then Celery's task lines carry their return values.
    log_content: bool = False
    # Celery warns at each worker start when it runs as root. None: silenced in a container
    # (/.dockerenv or /run/.containerenv), where root is the norm; true/false: always/never.
    allow_root: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _fold_engine_args(cls, data: Any) -> Any:
        """An engine argument that is also a setting (max_model_len, dtype, ...) becomes the
        setting, so that every stage sees one value; given both ways, it must agree."""
        if not isinstance(data, dict) or not isinstance(data.get("engine_args"), dict):
            return data
        from llmpipe.engines.vllm_args import SETTING_ALIASES

        data, args = dict(data), dict(data["engine_args"])
        for name in SETTING_ALIASES:
            if name not in args:
                continue
            value = args.pop(name)
            if data.get(name) is not None and str(data[name]).lower() != str(value).lower():
                raise ValueError(f"{name} is given twice, as a setting ({data[name]!r}) and as an engine argument "
                                 f"({value!r}): give it once")
            data[name] = value
        data["engine_args"] = args
        return data

    @property
    def effective_visibility_timeout_s(self) -> float:
        return self.visibility_timeout_s if self.visibility_timeout_s else self.max_timeout_s + 60

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return (init_settings, env_settings, _ConfigFileSource(settings_cls), file_secret_settings)

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
