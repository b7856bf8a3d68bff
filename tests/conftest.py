"""Fixtures shared across test folders."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.events_helpers import ipc_endpoints
from tests.mistake_helpers import pool_path


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


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A private temp dir with a short path (ipc:// paths in it stay under the socket limit)."""
    d = Path(tempfile.mkdtemp(prefix="kvo-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pool() -> Iterator[str]:
    """A fresh pool file path in /dev/shm; the pool and its index go afterwards."""
    path = pool_path()
    yield path
    for leftover in (path, f"{path}.index"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
