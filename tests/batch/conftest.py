"""The batch store's tests run each case on a real SQLite file and a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tokenfleet.batch.store import BatchStore


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'batches.db'}"
    postgres_url: str = request.getfixturevalue("postgres_url")
    return postgres_url


@pytest.fixture
def store(url: str) -> Iterator[BatchStore]:
    with BatchStore(url) as store:
        yield store
