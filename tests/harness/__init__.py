"""The tests' harness: one package for what tests share (import from it; conftests cannot
be imported).

- ``plugin``: the pytest plugin (tests/conftest.py loads it): the session's Redis, the tiny
  models, the brokers and the each_broker rule, ``borrow``, the reliability table; in an
  xdist controller, the Compose run's images built from the run's start (tests/deploy/prebuild.py).
- ``engine``: the engine every test stack runs (float32, eager) and vLLM's CPU environment.
- ``stacks``: a LocalPipeline on the tests' settings (``start_pipeline``), ``teardown``, and
  ``SharedPipeline``, one that the modules asking for the same engine and broker borrow.
- ``shared``: the session's pool of shared stacks and ``@lends``, which says when each stops.
- ``distribute``, ``xdist_groups``: the groups of modules one test process runs whole, and
  the pytest-xdist scheduler that hands them out longest first.
- ``pipe``: ``Pipe``, a pipeline on its own Redis with the levers the reliability tests pull.
- ``up``: ``llmpipe up`` as a user runs it (``Up``, ``UpPipe``) and the job helpers on it.
- ``vllm_pair``: ``vllm serve`` beside an llmpipe pipeline, and the helpers that compare them.
- ``celery_cli``: ``PlainCelery``, stages started with Celery's own commands.
- ``faults``: the fault injector's markers, the shipped recovery bounds, the fault pipeline.
- ``brokers``: the brokers under test, RabbitMQ vhosts, kombu on the lease transport.
- ``clients``: a job submitted, read and waited for through the job API.
- ``waiting``: ``wait_until`` / ``wait_for``, the one polling loop.
- ``clock``: ``ManualClock``, the clock a unit test moves by hand. ``together``: ``call_together``,
  calls released at once from their own threads, so that a batcher sees them in one window.
- ``watch``: results published per task id, peak memory. ``fuzz``: schemathesis.
- ``rows``: the reliability table.
"""
