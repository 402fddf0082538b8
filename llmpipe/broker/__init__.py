"""The broker and Redis plumbing: the lease transport, Redis clients, result backends, queue depths, requeue."""
