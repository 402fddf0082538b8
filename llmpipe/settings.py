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
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from llmpipe.broker.queue_depth import is_amqp
from llmpipe.broker.redis_clients import check_url
from llmpipe.engines.vllm_args import SETTING_ALIASES
from llmpipe.models.served import ModelSpecError, model_set
from llmpipe.parsing.config import ModelParsers
from llmpipe.parsing.config import resolve as resolve_parsers


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
    # redis://, rediss://, unix:// or sentinel://h1:26379/0;sentinel://h2:26379/0;... (Redis
    # Sentinel, llmpipe/broker/redis_clients.py) for the broker, the results and every record.
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_sentinel_master: str = "mymaster"  # the master's name in the sentinels' config (sentinel:// only)
    # The Celery broker; None: Redis at redis_url. amqp://...: RabbitMQ (quorum queues,
    # publisher confirms; docs/reliability.md, "RabbitMQ"); Redis still holds results, jobs,
    # admission and token streams.
    broker_url: str | None = None
    state_dir: Path = Field(default_factory=_state_dir_default)

    # Model and engine
    model: str = "smollm2"  # "smollm2", "tiny", a local folder, or a hub id
    # Several models behind one API (llmpipe/models/served.py): each "SOURCE" or "NAME=SOURCE",
    # the first the default; one inference worker (and queue inference.<name>) per model.
    # Empty: the one ``model`` above, on the queue ``inference``. In the environment a JSON
    # list or comma-separated (LLMPIPE_MODELS=smollm2,tiny); in the config file a list.
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    engine: EngineKind = EngineKind.VLLM
    # None: vLLM's own default, as `vllm serve` picks it (llmpipe/engines/platform.py): dtype
    # auto (float32 on a CPU without bf16 instructions), compiled (CUDA graphs on a GPU,
    # torch.compile on the CPU), 0.9 of the GPU, vLLM's own max_num_seqs; the transformers
    # engine takes bf16 on CUDA, float32 on the CPU.
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

    # Tool calls and reasoning, as vllm serve's --enable-auto-tool-choice, --tool-call-parser and
    # --reasoning-parser (vLLM's parser names): for every served model, and per model by its
    # served name in model_parsers ({"qwen": {"reasoning_parser": "qwen3"}}). The chat stages parse
    # with vLLM's own parser classes (llmpipe/parsing/). tool_strict_level: vLLM's
    # --tool-strict-level (llmpipe/parsing/config.py STRICT_LEVELS). trust_request_chat_template:
    # vLLM's --trust-request-chat-template (a request's own chat_template is refused without it).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    tool_strict_level: str = "auto"
    model_parsers: dict[str, dict[str, Any]] = Field(default_factory=dict)
    trust_request_chat_template: bool = False

    # Inference workers per served model that `llmpipe up` starts (docs/operations.md, "Several
    # inference workers"): a number for every model, or {name: number} (in the environment
    # also NAME=N,NAME=N). On CUDA each worker gets GPUs of its own (tensor_parallel_size each).
    inference_workers: Annotated[int | dict[str, int], NoDecode] = 1
    # Prefix-aware routing (llmpipe/routing/): while a model has more than one live inference
    # worker, preprocess sends each request to the worker where its prompt's leading blocks
    # last went (that worker's own queue), unless that worker holds more than
    # route_load_factor x the mean in-flight requests; what no worker can take goes to the
    # model's shared queue. Off: every request goes to the shared queue.
    prefix_routing: bool = True
    route_load_factor: float = Field(1.25, ge=1.0)
    route_prefix_ttl_s: float = Field(600.0, gt=0)  # how long where a prefix went is remembered
    # The token block the prefix hashes are taken over; None: the engine's own (vLLM's block
    # size, which the inference workers report; 16 until one has).
    route_block_size: int | None = Field(None, gt=0)

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
    # Priority lanes (llmpipe/jobs/lanes.py): a request of priority >= lane_batch_priority is in
    # the batch lane (vLLM's default 0 stays interactive), which is admitted only while the
    # queues and queued tokens are under this share of the limits above, so a batch backlog
    # gets 429 while interactive requests still have the rest of the budget.
    lane_batch_priority: int = 1
    lane_batch_share: float = Field(0.5, gt=0.0, le=1.0)
    # For lane_slot_hold_s after the last interactive request, the batch lane holds at most
    # this share of each worker's slots: its prefetch (a consumer on Redis then claims only
    # interactive messages beyond it) and, on a continuous engine, the running slots. A
    # batch-only load keeps them all (hold 0: the batch lane is never held to its share).
    # 1/32: 4 of vLLM's 128 running slots on a CPU (8 made the interactive TTFT p50 1.23x and
    # p99 1.69x the idle stack's under a draining batch), docs/benchmarks.md "The Batch API".
    lane_batch_slot_share: float = Field(0.03125, gt=0.0, le=1.0)
    lane_slot_hold_s: float = Field(30.0, ge=0.0)
    # While the batch lane is held to its share, at most this many of its requests are in
    # their prefill at once on a continuous engine (the next enters at the engine's first token
    # for one before it), so that an interactive request never shares a step with a burst of
    # batch prefills (docs/benchmarks.md "The Batch API").
    lane_batch_starting: int = Field(1, ge=1)
    # Between interactive requests, the share of each consumer's prefetch that batch-lane
    # messages never take on Redis (rounded down), so that the first interactive request
    # after a quiet spell finds a thread: 16 of the inference worker's 256 on vLLM.
    lane_interactive_reserve: float = Field(0.0625, ge=0.0, lt=1.0)

    # Pools
    cpu_workers: int = 2
    # The CPU stages' (preprocess, postprocess) Celery pool: prefork (cpu_workers processes
    # fed by one parent), threads (cpu_workers threads in one process) or solo (one task at
    # a time in the consuming process). docs/benchmarks.md measures them.
    cpu_pool: Literal["prefork", "threads", "solo"] = "prefork"
    # A local pipeline (`llmpipe up`) runs its API, CPU stages, Flower and embedded Redis on
    # the CPUs that vLLM on a CPU leaves free, off those its forward passes are bound to
    # (llmpipe/local/placement.py; docs/operations.md). An engine on a GPU binds none.
    isolate_engine_cpus: bool = True
    api_port: int = 8000
    flower_port: int = 5555
    flower_user: str = "admin"
    flower_password: str = ""
    api_keys: str = ""  # comma-separated bearer keys; empty disables auth

    # Supervision by `llmpipe up` (llmpipe/local/restarts.py): a child that exits on its own is
    # restarted after 1 s, doubling to 30 s; at the restart_max_crashes-th crash within
    # restart_window_s, `llmpipe up` gives up and stops the stack (docs/reliability.md).
    restart_max_crashes: int = Field(5, ge=1)  # past a flaky moment, short of a crash loop burning the machine
    restart_window_s: float = Field(300.0, gt=0)  # 5 crashes in 5 min with 1-16 s backoff: the engine keeps failing

    # SIMULATED engine (benchmarks only): the GPU cost model, see llmpipe/engines/simulated.py.
    # Defaults: ~346 ms of "GPU" time for one 512-token prompt with 64 output tokens.
    sim_prefill_ms_per_token: float = 0.1
    sim_step_ms: float = 4.6  # one decode step of a batch of one
    sim_step_ms_per_seq: float = 0.15  # added to a step per extra sequence in the batch
    # Schedule step by step as vLLM does (continuous batching, by priority) instead of whole batches.
    sim_continuous: bool = False
    # Simulated CPU work (busy loop, CPU time) per prompt in the pre/post stages; 0: none.
    # Benchmarks only (`llmpipe bench --engine simulated`); never set in production.
    sim_preprocess_cpu_ms: float = 0.0
    sim_postprocess_cpu_ms: float = 0.0

    # Reliability (docs/reliability.md)
    # Worker leases on the Redis broker (llmpipe/broker/leases.py). A worker whose lease was not
    # renewed for this long is dead: its messages go back to the front of their queues. Short,
    # since renewals come from a thread every lease_ttl_s / 3, not from the tasks.
    lease_ttl_s: float = 4.0
    # Every consumer sweeps for dead leases this often: a dead worker's messages are back
    # within lease_ttl_s + lease_sweep_interval_s (5 s) of its death.
    lease_sweep_interval_s: float = 1.0
    # The last resort for a message that no lease holds (a consumer without leases): it is
    # redelivered after this long; None: max_timeout_s + 60, longer than any job may live.
    visibility_timeout_s: float | None = None
    unacked_restore_interval_s: float = 10.0  # how often workers look for such messages
    max_deliveries: int = 3  # an inference request delivered more often (it kills its worker) is dead-lettered
    deadletter_ttl_s: int = 7 * 24 * 3600
    deadletter_max_entries: int = 10_000
    # The deadline watchdog (llmpipe/jobs/watchdog.py) in postprocess/collect workers; 0 disables it.
    watchdog_interval_s: float = 2.0
    watchdog_grace_s: float = 5.0  # how long after its deadline an unfinished job is settled
    # How long a worker retries recording a task's outcome (chord counter, failure state)
    # while Redis is unreachable; past it the message is acked and the watchdog settles the
    # job, so a Redis outage never leaves a message unacked on a live worker (llmpipe/broker/result_backend.py).
    outcome_retry_s: float = 15.0
    # Task events feed Flower; off, Flower shows nothing but each task costs less CPU and Redis.
    task_events: bool = True

    # The OpenAI Batch API (/v1/files, /v1/batches; api/batches/, llmpipe/batches/). File contents
    # live in batch_storage_dir (None: state_dir/batches; a shared mount when API processes run on
    # several hosts), their records and each batch's progress in Redis. The limits are OpenAI's.
    batch_storage_dir: Path | None = None
    batch_max_file_bytes: int = Field(200 * 1024 * 1024, ge=1)
    batch_max_lines: int = Field(50_000, ge=1)
    # Files and batches are forgotten (records and contents) this long after they were made
    # (OpenAI keeps batch files 30 days).
    batch_retention_s: int = Field(30 * 24 * 3600, ge=60)
    # Lines of one batch in flight at once (submitted, not yet written); admission's 429s
    # shrink the window below it (AIMD), and the batch lane's share keeps interactive room.
    batch_max_in_flight: int = Field(256, ge=1)
    # A batch is fed by the API process that holds its lease; one that stops renewing it (it
    # died) loses it after this long, and any live API process takes the batch over.
    batch_lease_ttl_s: float = Field(15.0, gt=0)
    batch_scan_interval_s: float = Field(1.0, gt=0)  # how often an API process looks for batches to feed
    # A line whose job expired (its deadline passed in the queues, not the batch's window) or
    # met an outage is run again, up to this many runs in all.
    batch_line_attempts: int = Field(3, ge=1)
    batch_feeder: bool = True  # this API process feeds batches (off: it only serves their API)

    # Logs (docs/architecture.md, "Logs"). No prompt or generated content is logged unless
    # this is on (debugging only): then Celery's task lines carry their return values.
    log_content: bool = False
    # Celery warns at each worker start when it runs as root. None: silenced in a container
    # (/.dockerenv or /run/.containerenv), where root is the norm; true/false: always/never.
    allow_root: bool | None = None

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        return v if v == "embedded" else check_url(v)  # "embedded": `llmpipe up` starts one

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            v = json.loads(v) if v.startswith("[") else [p for p in v.split(",") if p.strip()]
        return v

    @field_validator("inference_workers", mode="before")
    @classmethod
    def _inference_workers(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        v = v.strip()
        if v.startswith("{"):
            return json.loads(v)
        if "=" not in v:
            return v
        pairs = [p.partition("=") for p in v.split(",") if p.strip()]
        return {name.strip(): n.strip() for name, _, n in pairs}

    def workers_of(self, model: str) -> int:
        """How many inference workers ``llmpipe up`` starts for the served model ``model``."""
        n = self.inference_workers
        return n if isinstance(n, int) else n.get(model, 1)

    @model_validator(mode="after")
    def _check_models(self) -> Settings:
        try:
            served = self.served  # names parse and are unique
        except ModelSpecError as exc:
            raise ValueError(str(exc)) from None
        if self.models:
            # ``model`` is the default (first) one's source, for code that reads one model.
            self.model = served.default.source
        counts = self.inference_workers if isinstance(self.inference_workers, dict) else {"": self.inference_workers}
        unknown = sorted(set(counts) - {""} - set(served.names))
        if unknown:
            raise ValueError(f"inference_workers names {', '.join(unknown)}, which is not a served model "
                             f"({', '.join(served.names)})")
        if any(n < 1 for n in counts.values()):
            raise ValueError("inference_workers must be at least 1 per model")
        return self

    @model_validator(mode="after")
    def _check_parsers(self) -> Settings:
        for name in self.model_parsers:
            if name not in self.served.names:
                raise ValueError(f"model_parsers names {name!r}, which is not a served model ({', '.join(self.served.names)})")
        for m in self.served.models:
            self.parsers(m.name).check("" if not self.model_parsers else f"model {m.name}: ")
        return self

    def parsers(self, model: str | None = None) -> ModelParsers:
        """The served model's parsers (llmpipe/parsing/config.py); None: the default model."""
        name = self.served.get(model).name
        defaults = ModelParsers(self.tool_call_parser, self.reasoning_parser, self.enable_auto_tool_choice,
                                self.tool_strict_level)
        return resolve_parsers(defaults, self.model_parsers, name)

    @property
    def served(self):
        """The served models (llmpipe/models/served.py ModelSet): ``models``, else ``model``."""
        return model_set(self.model, self.models)

    @model_validator(mode="before")
    @classmethod
    def _fold_engine_args(cls, data: Any) -> Any:
        """An engine argument that is also a setting (max_model_len, dtype, ...) becomes the
        setting, so that every stage sees one value; given both ways, it must agree."""
        if not isinstance(data, dict) or not isinstance(data.get("engine_args"), dict):
            return data
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
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def broker_is_amqp(self) -> bool:
        return is_amqp(self.effective_broker_url)

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
    def batch_dir(self) -> Path:
        return self.batch_storage_dir if self.batch_storage_dir is not None else self.state_dir / "batches"

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
