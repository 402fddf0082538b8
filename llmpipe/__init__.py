"""llmpipe: an LLM serving pipeline on Celery (preprocess -> batched inference -> postprocess)."""

__version__ = "0.1.0"
