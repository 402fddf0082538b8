"""A Redis result backend for processes that poll results and never wait on them."""

from celery.backends.redis import RedisBackend, SentinelBackend

from llmpipe.broker.redis_clients import celery_url, is_sentinel


class _Polling:
    """Celery's Redis backend subscribes to a pub/sub channel for every task it sends and
    every chord it builds, and keeps the subscription until the result is fetched. The
    API only polls, so it subscribes to nothing."""

    def on_task_call(self, producer, task_id):
        pass

    def add_pending_result(self, result, weak=False, start_drainer=True):
        return result

    def remove_pending_result(self, result):
        return result


class PollingRedisBackend(_Polling, RedisBackend):
    pass


class PollingSentinelBackend(_Polling, SentinelBackend):
    """The same over Redis Sentinel (``sentinel://`` URLs, llmpipe/broker/redis_clients.py)."""


def polling_backend_url(redis_url: str) -> str:
    cls = PollingSentinelBackend if is_sentinel(redis_url) else PollingRedisBackend
    return f"{__name__}:{cls.__name__}+{celery_url(redis_url)}"
