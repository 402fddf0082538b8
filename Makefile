# The two commands of the README: `make up` serves, `make test` tests. Both set up .venv first.
ARGS ?=
PYTEST_ARGS ?=

.PHONY: bootstrap up test test-fast bench

bootstrap:
	@scripts/bootstrap.sh

up: bootstrap
	.venv/bin/llmpipe up $(ARGS)

test: bootstrap
	.venv/bin/python -m pytest $(PYTEST_ARGS)

test-fast: bootstrap
	.venv/bin/python -m pytest -m "not integration and not slow" $(PYTEST_ARGS)

bench: bootstrap
	.venv/bin/llmpipe bench $(ARGS)
