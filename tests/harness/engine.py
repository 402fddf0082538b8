"""The engine every test runs, and the environment vLLM on the CPU needs in tests.

The engine of a test's stack is float32, so that token ids match exactly between engines and
runs, and eager, so that an engine starts in seconds instead of compiling. The shipped
defaults (vLLM's own, compiled; float32 on a CPU without bf16: llmpipe/engines/platform.py)
run where a test is about them: the kill matrix (tests/harness/up.py start_up) and
tests/deploy/test_compose_up.py."""

from __future__ import annotations

import os

TEST_ENGINE = {"dtype": "float32", "enforce_eager": True}
TEST_ENGINE_ENV = {"LLMPIPE_DTYPE": "float32", "LLMPIPE_ENFORCE_EAGER": "true"}

# vLLM on CPU in tests: the executor in the engine-core process (no third process importing vLLM, a faster
# start), a small KV cache, loopback.
TEST_VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_test_env() -> None:
    """TEST_VLLM_ENV into this process's environment, where not set already."""
    for k, v in TEST_VLLM_ENV.items():
        os.environ.setdefault(k, v)
