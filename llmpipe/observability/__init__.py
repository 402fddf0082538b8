"""Metrics, readiness, log summaries, the start-up heap of long-lived processes, and the
sender of Celery's task events."""
