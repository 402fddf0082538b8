"""Operator endpoints: ``/healthz``, ``/metrics`` and the dead-letter record."""
