"""Separate hosts on one machine, for tests and the scaling benchmark: Linux network
namespaces on a private switch (:mod:`llmpipe.testing.hosts.netns`), processes inside them and
delaying TCP proxies between them (:mod:`llmpipe.testing.hosts.harness`,
:mod:`llmpipe.testing.hosts.proxy`), and the llmpipe layout over them
(:mod:`llmpipe.testing.hosts.pipeline`). Needs root and iproute2. See docs/benchmarks.md.
"""
