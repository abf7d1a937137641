"""The batch store's tests run each case on a real SQLite file and a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.postgres import store_url

from tokenfleet.batch.store import BatchStore


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return store_url(request, tmp_path)


@pytest.fixture
def store(url: str) -> Iterator[BatchStore]:
    with BatchStore(url) as store:
        yield store
