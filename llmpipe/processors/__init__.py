"""Stage logic as plain classes, tested without Celery. tasks/ wraps them thinly."""
