"""Fixtures of the gateway tests: the scripted fake model (:mod:`orchard_env.fake_model`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchard_env.fake_model import FakeModel, running


@pytest.fixture
def fake_model() -> Iterator[FakeModel]:
    """The fake model on loopback, on its own thread; ``fake_model.script`` may be replaced."""
    with running() as fake:
        yield fake
