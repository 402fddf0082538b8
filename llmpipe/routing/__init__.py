"""Prefix-aware routing of inference requests, decided in preprocess (docs/architecture.md,
"Prefix-aware routing").

Each inference worker consumes its model's shared queue and a queue of its own
(llmpipe/stages.py ``worker_queue``). Preprocess holds each prompt's token ids: it hashes the
prompt's leading token blocks (prefix.py) and asks Redis, in one script call, where the
longest of those prefixes last went (router.py). That worker gets the request on its own
queue, where its engine most likely still caches the prefix, unless it holds more than its
share of the model's in-flight requests (consistent hashing with bounded loads) or it is no
longer live; then the next worker in the prefix's hash order that has room gets it, and
when none has, the shared queue does. The workers keep their membership, capacity and
in-flight count in Redis (members.py); a dead worker's own queue is drained back to the
shared queue (llmpipe/broker/worker_queues.py).
"""
