"""Fixtures shared by the event-layer tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from tests.events_helpers import ipc_endpoints


@pytest.fixture
def ipc() -> Iterator[Callable[[str], str]]:
    """Short ipc:// endpoints in a private temp dir: ``ipc("name")``."""
    yield from ipc_endpoints()


@pytest.fixture
def registry() -> CollectorRegistry:
    """A fresh Prometheus registry, so counters start at zero in every test."""
    return CollectorRegistry()
