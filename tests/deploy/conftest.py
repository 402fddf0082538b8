"""docker-compose.yml, read once per module."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.compose_spec import COMPOSE_FILE


@pytest.fixture(scope="module")
def compose_text() -> str:
    return COMPOSE_FILE.read_text()


@pytest.fixture(scope="module")
def compose(compose_text) -> dict:
    # safe_load resolves anchors, aliases and `<<` merge keys like Compose does.
    data = yaml.safe_load(compose_text)
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]
