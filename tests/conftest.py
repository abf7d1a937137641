"""Shared fixtures: the bundled model folder, converted once per machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# A real PostgreSQL for the batch store's tests (postgres_url), where one is given.
pytest_plugins = ("support.postgres",)

# Set by .ci/run: under CI nothing the project ships may be left out, so a skip fails.
UNDER_CI = os.environ.get("TOKENFLEET_CI") == "1"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _private_data_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Servers the tests start never touch the user's batch store.
    os.environ["TOKENFLEET_DATA_DIR"] = str(tmp_path_factory.mktemp("tokenfleet-data"))


@pytest.fixture(scope="session")
def model_folder() -> Path:
    from tokenfleet import envs
    from tokenfleet.checkpoint.bundled import prepare_bundled_model

    return prepare_bundled_model(envs.cache_dir() / "models", progress=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """Under CI (TOKENFLEET_CI=1) a skip, in setup or in the test, is reported as a failure."""
    report: pytest.TestReport = yield
    if UNDER_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI (TOKENFLEET_CI=1), which allows no skip: {reason}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    """Under CI a module that skips itself whole (pytest.skip, importorskip) fails too."""
    report: pytest.CollectReport = yield
    if UNDER_CI and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI (TOKENFLEET_CI=1), which allows no skip: {reason}"
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line that says how much of the run used stand-ins and how much was skipped."""
    reports = [
        r
        for key in ("passed", "failed", "skipped", "error")
        for r in terminalreporter.stats.get(key, [])
        if getattr(r, "when", "call") in ("call", "setup")
    ]
    fakes = {r.nodeid for r in reports if "fake" in r.keywords}
    skipped = {r.nodeid for r in terminalreporter.stats.get("skipped", [])}
    terminalreporter.write_line(
        f"tokenfleet: {len(fakes)} tests use a named stand-in (marker `fake`), "
        f"{len(skipped)} skipped"
    )
