"""What a worker process owns, loaded lazily once per process, with a shutdown path: each
served model's tokenizer and CPU-stage processors, the engine and its InferenceProcessor,
the Redis clients, and the stage bodies the tasks run (llmpipe/processors/).

Celery's worker_shutdown / worker_process_shutdown signals call ``shutdown_all``; a task
reaches its process's context as ``self.ctx`` (workers/stage_task.py).
"""

from __future__ import annotations

import os
import threading
from functools import cached_property

import redis

from llmpipe.broker.redis_clients import connect, from_settings, ride_through_retry
from llmpipe.engines.factory import create_engine
from llmpipe.engines.owner import EngineOwner
from llmpipe.jobs import admission
from llmpipe.jobs.deadletter import DeadLetters, TaskFailures
from llmpipe.jobs.memo import StageMemo
from llmpipe.jobs.store import JobStore
from llmpipe.messages import TokenizedRequest
from llmpipe.models.registry import resolve_model
from llmpipe.parsing.vllm_parsers import ModelParser
from llmpipe.processors.collector import JobFinisher
from llmpipe.processors.cpu_stages import PostprocessStage, PreprocessStage, TokenizeStage
from llmpipe.processors.inference_processor import InferenceProcessor
from llmpipe.processors.inference_stage import InferenceStage
from llmpipe.processors.input_processor import InputProcessor
from llmpipe.processors.output_processor import OutputProcessor
from llmpipe.processors.tokenizer import TokenizerOwner, model_context_length, model_vocab_size
from llmpipe.routing.keys import routing_redis_url
from llmpipe.routing.members import RouteMember
from llmpipe.routing.router import PrefixRouter
from llmpipe.settings import Settings, get_settings
from llmpipe.stages import Stage
from workers import hook
from workers.inference_runtime import InferenceRuntime, start_inference
from workers.launch import KINDS
from workers.route_member import start_member


class ModelResources:
    """One served model's tokenizer and CPU-stage processors in this process, each loaded
    once, on first use: a CPU worker serves every model and pays only for those it is asked for."""

    def __init__(self, settings: Settings, source: str, name: str | None = None):
        self.settings = settings
        self.source = source
        self.name = name or settings.served.default.name

    @cached_property
    def model_path(self) -> str:
        return resolve_model(self.source, self.settings.models_dir)

    @cached_property
    def tokenizer_owner(self) -> TokenizerOwner:
        return TokenizerOwner(self.model_path)

    @cached_property
    def context_len(self) -> int:
        n = model_context_length(self.model_path) or 2048
        return min(n, self.settings.max_model_len) if self.settings.max_model_len else n

    @cached_property
    def parser(self) -> ModelParser | None:
        """The model's tool-call and reasoning parsers (vLLM's; imported on first use), if it has any."""
        parsers = self.settings.parsers(self.name)
        return ModelParser(self.tokenizer_owner.get(), parsers, self.name) if parsers.any else None

    @cached_property
    def input_processor(self) -> InputProcessor:
        return InputProcessor(self.tokenizer_owner.get(), self.context_len, vocab_size=model_vocab_size(self.model_path),
                              parser=self.parser)

    @cached_property
    def output_processor(self) -> OutputProcessor:
        return OutputProcessor(self.tokenizer_owner.get(), parser=self.parser)

    def shutdown(self) -> None:
        if "tokenizer_owner" in self.__dict__:
            self.tokenizer_owner.shutdown()


WORKER_MODEL_ENV = "LLMPIPE_WORKER_MODEL"  # the model an inference worker serves (workers/pool_policy.py sets it)
# An inference worker's own queue (prefix-aware routing) and the requests it holds at once (pool_policy sets them).
WORKER_QUEUE_ENV = "LLMPIPE_WORKER_QUEUE"
WORKER_CAPACITY_ENV = "LLMPIPE_WORKER_CAPACITY"
WORKER_NODE_ENV = "LLMPIPE_WORKER_NODE"  # an inference worker's Celery node name


class WorkerContext:
    def __init__(self, settings: Settings | None = None):
        self.settings = settings or get_settings()
        self._lock = threading.Lock()
        self._inference: InferenceRuntime | None = None
        self._models: dict[str, ModelResources] = {}
        self._models_lock = threading.Lock()  # not _lock: inference() holds that while it reads the model
        self._member: RouteMember | None = None  # this inference worker's routing membership

    @property
    def served(self):
        return self.settings.served

    @property
    def own_model(self):
        """The model this process's engine runs: the one its inference queue names
        (LLMPIPE_WORKER_MODEL), else the default (first) one."""
        return self.served.get(os.environ.get(WORKER_MODEL_ENV) or None)

    def model(self, name: str | None = None) -> ModelResources:
        """``name``'s tokenizer and processors (None: the default model); unknown: ModelNotFoundError."""
        m = self.served.get(name)
        res = self._models.get(m.name)
        if res is None:
            with self._models_lock:
                res = self._models.setdefault(m.name, ModelResources(self.settings, m.source, m.name))
        return res

    # The own model's, for code that serves one model (the inference worker, the tests).
    @property
    def model_path(self) -> str:
        return self.model(self.own_model.name).model_path

    @property
    def tokenizer_owner(self):
        return self.model(self.own_model.name).tokenizer_owner

    @property
    def context_len(self) -> int:
        return self.model(self.own_model.name).context_len

    @property
    def input_processor(self):
        return self.model(self.own_model.name).input_processor

    @property
    def output_processor(self):
        return self.model(self.own_model.name).output_processor

    @cached_property
    def redis(self) -> redis.Redis:
        return from_settings(self.settings, socket_timeout=5, socket_connect_timeout=3, health_check_interval=30,
                             retry=ride_through_retry())

    @cached_property
    def jobs(self) -> JobStore:
        return JobStore(self.redis, self.settings.result_ttl_s)

    @cached_property
    def memo(self) -> StageMemo:
        """Stage results by request id, so a redelivered message re-runs nothing (llmpipe/jobs/memo.py)."""
        s = self.settings
        # The memo outlives the latest redelivery: a dead lease's messages come back within
        # lease_ttl_s + sweep, and the visibility timeout (the last resort) bounds the rest.
        redelivery_s = max(s.lease_ttl_s + s.lease_sweep_interval_s,
                           s.effective_visibility_timeout_s + s.unacked_restore_interval_s)
        return StageMemo(self.redis, slack_s=redelivery_s + 60, max_deliveries=s.max_deliveries)

    @cached_property
    def deadletters(self) -> DeadLetters:
        return DeadLetters(self.redis, ttl_s=self.settings.deadletter_ttl_s, max_entries=self.settings.deadletter_max_entries)

    @cached_property
    def engine_owner(self) -> EngineOwner:
        return EngineOwner(lambda: hook.wrap_engine(create_engine(self.settings, self.model_path, self.own_model.name),
                                                    self.settings, self.model_path))

    def inference(self) -> InferenceProcessor:
        """The process's InferenceProcessor (engine + batcher), built on first use."""
        if self._inference is None:
            with self._lock:
                if self._inference is None:
                    own = os.environ.get(WORKER_QUEUE_ENV) or None
                    self._inference = start_inference(self.engine_owner.get(), self.redis, self.settings,
                                                      self.own_model, self.model(self.own_model.name), own_queue=own,
                                                      worker=os.environ.get(WORKER_NODE_ENV) or f"pid{os.getpid()}")
                    if own is not None:
                        held = os.environ.get(WORKER_CAPACITY_ENV) or KINDS[Stage.INFERENCE].concurrency(self.settings)
                        self._member = start_member(self.engine_owner.get(), self.route_redis, self.settings, own,
                                                    int(held))
        return self._inference.processor

    # -- what the tasks run (tasks/*.py), each built on first use -------------------------
    @cached_property
    def finisher(self) -> JobFinisher:
        s = self.settings
        # Without admission limits the API reserved nothing (llmpipe/jobs/admission.py).
        admitted = admission.enabled(s.max_queue_depth, s.max_queued_prompt_tokens)
        return JobFinisher(self.jobs, release=lambda j: admission.release(self.redis, j) if admitted else None,
                           forget=self.memo.forget, default_model=self.served.default.name)

    @cached_property
    def preprocess_stage(self) -> PreprocessStage:
        return PreprocessStage(self.jobs, self.model, self.served.default.name,
                               route=self._route if self.settings.prefix_routing else None)

    # -- prefix-aware routing (llmpipe/routing/) ------------------------------------------
    @cached_property
    def route_redis(self) -> redis.Redis:
        """The Redis of the routing keys: the broker's when it is Redis (next to the leases)."""
        return connect(routing_redis_url(self.settings), self.settings.redis_sentinel_master, socket_timeout=5,
                       socket_connect_timeout=3, health_check_interval=30)

    @cached_property
    def router(self) -> PrefixRouter:
        s = self.settings
        engine_block = s.engine_args.get("block_size")  # as given: `--engine-arg block_size=32` is a string
        return PrefixRouter(self.route_redis, load_factor=s.route_load_factor, prefix_ttl_s=s.route_prefix_ttl_s,
                            block_size=s.route_block_size or (int(engine_block) if engine_block else None))

    def _route(self, req: TokenizedRequest) -> str | None:
        m = self.served.get(req.model)
        return self.router.route(m.queue, req.prompt_token_ids, m.name)

    def leave_routing(self) -> None:
        """No more requests routed to this worker's own queue (a warm shutdown begins)."""
        if self._member is not None:
            self._member.leave()
            self._member = None

    @cached_property
    def inference_stage(self) -> InferenceStage:
        return InferenceStage(self.memo, self.inference, self.deadletters, model=self.own_model.name,
                              max_deliveries=self.settings.max_deliveries)

    @cached_property
    def postprocess_stage(self) -> PostprocessStage:
        return PostprocessStage(self.memo, self.model, self.served.default.name, self.finisher)

    @cached_property
    def tokenize_stage(self) -> TokenizeStage:
        return TokenizeStage(self.model)

    @cached_property
    def task_failures(self) -> TaskFailures:
        return TaskFailures(self.deadletters, self.jobs)

    def shutdown_all(self) -> None:
        self.leave_routing()
        if self._inference is not None:
            self._inference.shutdown()
            self._inference = None
        if "engine_owner" in self.__dict__:
            self.engine_owner.shutdown()
        for res in list(self._models.values()):
            res.shutdown()


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def context() -> WorkerContext:
    global _context
    if _context is None:
        with _context_lock:
            if _context is None:
                _context = WorkerContext()
    return _context


def reset_context() -> None:
    global _context
    if _context is not None:
        _context.shutdown_all()
    _context = None
