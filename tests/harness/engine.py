"""The engine every test runs, and the environment vLLM on the CPU needs in tests.

The engine of a test's stack is float32, so that token ids match exactly between engines and
runs, and eager, so that an engine starts in seconds instead of compiling. The shipped
defaults (vLLM's own, compiled; float32 on a CPU without bf16: llmpipe/engines/platform.py; a 1 GiB KV cache)
run where a test is about them: the kill matrix (tests/harness/up.py start_up) and
tests/deploy/test_compose_up.py."""

from __future__ import annotations

import os

# A quarter-GiB KV cache holds 32k tokens of the tiny model (8 KiB each in float32), more
# than any test asks for. vLLM zeroes the cache as it starts: alone here, 1 GiB took about
# 0.5 s and 0.9 CPU-s more per engine in the tests' mode (below), 2.2-2.5 s in vLLM's own.
KV_CACHE_GIB = 0.25
TEST_ENGINE = {"dtype": "float32", "enforce_eager": True, "kv_cache_gib": KV_CACHE_GIB}
TEST_ENGINE_ENV = {"LLMPIPE_DTYPE": "float32", "LLMPIPE_ENFORCE_EAGER": "true",
                   "LLMPIPE_KV_CACHE_GIB": str(KV_CACHE_GIB)}

# vLLM on CPU in tests: the executor in the engine-core process (no third process importing vLLM, a faster
# start), loopback. No VLLM_CPU_KVCACHE_SPACE: it would win over the engine's KV cache size,
# which the engine sets from its kv_cache_gib (llmpipe/engines/platform.py).
TEST_VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_test_env() -> None:
    """TEST_VLLM_ENV into this process's environment, where not set already; a
    VLLM_CPU_KVCACHE_SPACE of the shell's goes, so that each engine's kv_cache_gib holds."""
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    for k, v in TEST_VLLM_ENV.items():
        os.environ.setdefault(k, v)
