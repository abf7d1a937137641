"""The benchmark scripts in bench/: each one still starts (its imports resolve and its
command line parses), and none is a library of another (what two share is in bench/common).

Only `--help` runs here; the benchmarks themselves take minutes to hours.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))
SCRIPT_NAMES = {script.stem for script in SCRIPTS}
HELPERS = sorted((BENCH / "common").glob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """The top-level names of the modules `path` imports, anywhere in it (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_there_are_scripts_and_helpers() -> None:
    assert len(SCRIPTS) > 10, SCRIPTS
    assert (BENCH / "common" / "__init__.py").exists()
    assert "common" not in SCRIPT_NAMES  # `import common` must find the package


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_help(script: Path) -> None:
    """`python bench/<script>.py --help` as the docs run it: from the repository root, with
    bench/ on sys.path because the script is there. A module only a peer installs (vllm,
    llama_cpp) is imported where it is used, never at the top."""
    done = subprocess.run(
        [sys.executable, str(script.relative_to(REPO)), "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize(
    "path", SCRIPTS + HELPERS, ids=[str(p.relative_to(BENCH)) for p in SCRIPTS + HELPERS]
)
def test_no_script_imports_another(path: Path) -> None:
    """A script takes what it shares from bench/common, never from another script; nor does
    a helper in bench/common import a script."""
    others = SCRIPT_NAMES - {path.stem if path.parent == BENCH else ""}
    assert not imported_modules(path) & others


def test_servers_start_in_one_place() -> None:
    """A benchmark's server starts, is awaited and is stopped in bench/common/server.py and
    nowhere else: one `subprocess.Popen` and one `tokenfleet serve` command line."""
    server = BENCH / "common" / "server.py"
    for path in SCRIPTS + HELPERS:
        text = path.read_text()
        if path == server:
            assert text.count("subprocess.Popen(") == 1
            assert text.count('"tokenfleet.cli", "serve"') == 1
        else:
            assert "Popen" not in text, path
            assert '"tokenfleet.cli", "serve"' not in text, path
