"""The endpoints of vLLM's server besides ``/v1``: ``/health``, ``/ping``, ``/version``, ``/tokenize``, ``/detokenize``."""
