"""vLLM's tool-call and reasoning parsers behind small adapters (llmpipe/parsing/vllm_parsers.py),
and the settings that name them per model (llmpipe/parsing/config.py)."""
