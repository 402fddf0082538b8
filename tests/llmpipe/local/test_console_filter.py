"""What `llmpipe up` shows of a child's output: its warnings and errors, tracebacks included."""

import logging

from llmpipe.local.console_filter import LevelFilter

LOG = """\
[2026-11-30 11:41:40,011: INFO/MainProcess] Connected to redis://127.0.0.1:6379/0
[2026-11-30 11:42:01,036: INFO/MainProcess] (MainProcess pid=9869) INFO 11-30 11:42:01 [model.py:733] Resolved architecture
[2026-11-30 11:42:01,037: INFO/MainProcess] (MainProcess pid=9869) WARNING 11-30 11:42:01 [arg_utils.py:1] The global random seed is set to 0
(EngineCore pid=9937) INFO 11-30 11:42:13 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='x'
(EngineCore pid=9937) WARNING 11-30 11:42:13 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  5.09it/s]
[2026-11-30 11:42:40,967: INFO/MainProcess] Task llmpipe.inference[c5] succeeded in 2.8s: job_id=ef index=0
[2026-11-30 11:43:00,001: ERROR/MainProcess] Task llmpipe.postprocess[d1] raised unexpected: KeyError('x')
Traceback (most recent call last):
  File "/x/trace.py", line 479, in trace_task
KeyError: 'x'
[2026-11-30 11:43:01,000: INFO/MainProcess] Task llmpipe.collect[e2] succeeded in 0.01s: job_id=ef
/x/celery/platforms.py:841: SecurityWarning: You're running the worker with superuser privileges
  warnings.warn(SecurityWarning(ROOT_DISCOURAGED.format(
INFO:     127.0.0.1:56460 - "GET /health HTTP/1.1" 200 OK
WARNING:  Invalid HTTP request received.
[W 261130 11:25:37 web:1] 401 GET /api/workers
[I 261130 11:25:37 web:1] 200 GET /metrics
llmpipe: engine vllm could not start: EngineError: boom
"""


def test_warnings_errors_and_their_tracebacks_show_the_rest_does_not():
    f = LevelFilter(logging.WARNING)
    shown = [line for line in LOG.splitlines() if f.show(line)]
    assert shown == [
        "[2026-11-30 11:42:01,037: INFO/MainProcess] (MainProcess pid=9869) WARNING 11-30 11:42:01 [arg_utils.py:1] The global random seed is set to 0",
        "(EngineCore pid=9937) WARNING 11-30 11:42:13 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.",
        "[2026-11-30 11:43:00,001: ERROR/MainProcess] Task llmpipe.postprocess[d1] raised unexpected: KeyError('x')",
        "Traceback (most recent call last):",
        '  File "/x/trace.py", line 479, in trace_task',
        "KeyError: 'x'",
        "/x/celery/platforms.py:841: SecurityWarning: You're running the worker with superuser privileges",
        "  warnings.warn(SecurityWarning(ROOT_DISCOURAGED.format(",
        "WARNING:  Invalid HTTP request received.",
        "[W 261130 11:25:37 web:1] 401 GET /api/workers",
        "llmpipe: engine vllm could not start: EngineError: boom",
    ]


def test_verbose_shows_everything():
    f = LevelFilter(logging.DEBUG)
    assert all(f.show(line) for line in LOG.splitlines())
