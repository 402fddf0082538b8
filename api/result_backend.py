"""A Redis result backend for processes that poll results and never wait on them."""

from celery.backends.redis import RedisBackend


class PollingRedisBackend(RedisBackend):
    """Celery's Redis backend subscribes to a pub/sub channel for every task it sends and
    every chord it builds, and keeps the subscription until the result is fetched. The
    API only polls, so it subscribes to nothing."""

    def on_task_call(self, producer, task_id):
        pass

    def add_pending_result(self, result, weak=False, start_drainer=True):
        return result

    def remove_pending_result(self, result):
        return result


def polling_backend_url(redis_url: str) -> str:
    return f"{__name__}:PollingRedisBackend+{redis_url}"
