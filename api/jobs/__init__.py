"""The polling job API (``/v1/jobs``): router, protocol (bodies) and service (submit, read, cancel)."""
