# The two commands of the README: `make up` serves, `make test` tests. Both set up .venv first.
ARGS ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist); each runs whole groups of modules (tests/harness/distribute.py),
# handed out by tests/harness/xdist_groups.py, which stands in for the --dist given here.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

.PHONY: bootstrap bytecode up test test-fast bench

bootstrap:
	@scripts/bootstrap.sh

# Where PYTHONDONTWRITEBYTECODE is set (as on the development machines) no process writes the
# project's .pyc files, so each one compiles again every module of the project it imports:
# 0.1-0.4 s of CPU for a worker or the API here, and a test run starts hundreds of them.
# Compiled once here (under a second, then only what changed), they all read the bytecode;
# Python still compiles in memory any source that changed after this step.
bytecode: bootstrap
	@.venv/bin/python -m compileall -q -j0 api benchmarks llmpipe tasks tests workers celeryconfig.py >/dev/null

up: bytecode
	.venv/bin/llmpipe up $(ARGS)

test: bytecode
	.venv/bin/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: bytecode
	.venv/bin/python -m pytest $(XDIST) -m "not integration and not slow" $(PYTEST_ARGS)

bench: bytecode
	.venv/bin/llmpipe bench $(ARGS)
