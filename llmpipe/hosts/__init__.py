"""Separate hosts on one machine, for tests and the scaling benchmark: Linux network
namespaces on a private switch (:mod:`llmpipe.hosts.netns`), processes inside them and
delaying TCP proxies between them (:mod:`llmpipe.hosts.harness`,
:mod:`llmpipe.hosts.proxy`), and the llmpipe layout over them
(:mod:`llmpipe.hosts.pipeline`). Needs root and iproute2. See docs/benchmarks.md.
"""
