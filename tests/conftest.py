"""Fixtures shared across test folders."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

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


@pytest.fixture
def index_path() -> Iterator[Path]:
    """A fresh shared-index path in /dev/shm; the index and its session files go afterwards."""
    from kvoffload.daemon.store.session_file import session_glob

    p = Path(f"/dev/shm/kvoffload-test-idx-{uuid.uuid4().hex[:10]}")
    yield p
    p.unlink(missing_ok=True)
    for q in p.parent.glob(session_glob(p)):
        q.unlink(missing_ok=True)
