# The two commands of the README: `make up` serves, `make test` tests. Both set up .venv first.
ARGS ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist); each runs whole groups of modules (tests/harness/distribute.py),
# handed out by tests/harness/xdist_groups.py, which stands in for the --dist given here.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

.PHONY: bootstrap up test test-fast bench

bootstrap:
	@scripts/bootstrap.sh

up: bootstrap
	.venv/bin/llmpipe up $(ARGS)

test: bootstrap
	.venv/bin/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: bootstrap
	.venv/bin/python -m pytest $(XDIST) -m "not integration and not slow" $(PYTEST_ARGS)

bench: bootstrap
	.venv/bin/llmpipe bench $(ARGS)
