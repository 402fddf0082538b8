"""``llmpipe bench``: the load generator and side-by-side comparison of serving modes.

Importing this package is cheap; the heavy parts (vLLM, matplotlib) load only when a run
needs them. See docs/benchmarks.md for the modes, engines and measured numbers.
"""
