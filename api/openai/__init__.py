"""The OpenAI-compatible surface (``/v1/completions``, ``/v1/chat/completions``) on the job pipeline."""
