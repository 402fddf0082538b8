"""The HTTP API (FastAPI). It enqueues by task name and never imports torch or vLLM."""
