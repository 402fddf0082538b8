"""Metrics, readiness, log summaries and the start-up heap of long-lived processes."""
