"""A real PostgreSQL for the tests, one fresh schema per test.

The server's URL comes from TOKENFLEET_TEST_POSTGRES_URL (.ci/run sets it from
scripts/postgres-for-tests); a URL given there that does not connect fails the tests.
Unset, the fixture runs that script itself (outside CI without installing anything).
Where no PostgreSQL can be had the tests skip, saying so, except under CI (`.ci/run` sets
TOKENFLEET_CI=1; a `CI` environment variable counts too), where they fail: CI never passes
by leaving PostgreSQL out (tests/conftest.py also turns any skip under CI into a failure).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import SQLAlchemyError

from tokenfleet.batch.store import engine_url

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "postgres-for-tests"
URL_VARIABLE = "TOKENFLEET_TEST_POSTGRES_URL"


def _under_ci() -> bool:
    return os.environ.get("TOKENFLEET_CI") == "1" or bool(os.environ.get("CI"))


def _unavailable(why: str) -> NoReturn:
    if _under_ci():
        pytest.fail(f"PostgreSQL is required under CI: {why}")
    pytest.skip(
        f"no PostgreSQL here, so the store's PostgreSQL tests are skipped (allowed only "
        f"outside CI; set {URL_VARIABLE} or install PostgreSQL to run them): {why}"
    )


def _start_server() -> str:
    argv = [str(SCRIPT)] if _under_ci() else [str(SCRIPT), "--no-install"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        _unavailable(f"{SCRIPT.name} did not run: {exc}")
    if done.returncode != 0:
        _unavailable(f"{SCRIPT.name} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """The URL of a running PostgreSQL whose user may create schemas."""
    given = os.environ.get(URL_VARIABLE)
    url = given or _start_server()
    engine = create_engine(engine_url(url))
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        why = f"cannot connect to {engine.url!r}: {exc}"
        if given:
            pytest.fail(f"{URL_VARIABLE} is set, but {why}")
        _unavailable(why)
    finally:
        engine.dispose()
    return url


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A URL whose connections see only a fresh, empty schema; dropped afterwards."""
    schema = f"test_{uuid.uuid4().hex[:16]}"
    admin = create_engine(engine_url(postgres_server_url))
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    # Left as given (postgresql://): the store maps it to the psycopg driver itself.
    url = make_url(postgres_server_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A batch store's URL for a test parametrized over "sqlite" and "postgresql": a
    SQLite file in `tmp_path`, or the PostgreSQL schema of the `postgres_url` fixture."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'batches.db'}"
    postgres_url: str = request.getfixturevalue("postgres_url")
    return postgres_url
