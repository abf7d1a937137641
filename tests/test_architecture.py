"""The layering of docs/ARCHITECTURE.md: import-linter's contracts hold on the tree, fail on a
deliberately bad import, and the simulator's entry points load none of the heavy layers."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
HEAVY = ("torch", "fastapi", "sqlalchemy", "uvicorn", "ray")


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the `tokenfleet` package found in `tree`, with the project's
    contracts."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(tree / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "tokenfleet",
        tmp_path / "tokenfleet",
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_contracts_hold_on_the_tree() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


LAYERS = "Layers"
PLAIN = "Bookkeeping and the simulator are plain Python"
GATEWAY = "The gateway reaches a replica"


@pytest.mark.parametrize(
    ("module", "bad_import", "broken"),
    [
        # torch in the torch-free bookkeeping (which the gateway imports too)
        ("core/request.py", "import torch", {PLAIN, GATEWAY}),
        # the simulator reaching into the gateway (and with it, FastAPI)
        ("sim/run.py", "import tokenfleet.server.app", {LAYERS, PLAIN}),
        # a lower layer importing a higher one
        ("core/scheduler.py", "import tokenfleet.policy.harvest", {LAYERS}),
        # the gateway reaching into the runner
        ("server/service.py", "import tokenfleet.runner.sampler", {GATEWAY}),
    ],
)
def test_a_bad_import_breaks_its_contract(
    tree_copy: Path, module: str, bad_import: str, broken: set[str]
) -> None:
    path = tree_copy / "tokenfleet" / module
    path.write_text(path.read_text() + f"\n{bad_import}  # noqa\n")
    result = _lint_imports(tree_copy)
    assert result.returncode == 1, result.stdout
    # The summary lists each contract, KEPT or BROKEN; a long name may wrap onto two lines.
    summary = " ".join(result.stdout.split("Contracts\n---------", 1)[1].split())
    found = {name for name in (LAYERS, PLAIN, GATEWAY) if _verdict(summary, name) == "BROKEN"}
    assert found == broken, result.stdout


def _verdict(summary: str, name: str) -> str:
    """KEPT or BROKEN: whichever follows the contract's name first in the summary."""
    rest = summary.split(name, 1)[1]
    kept, broken = rest.find(" KEPT"), rest.find(" BROKEN")
    if broken == -1 or (kept != -1 and kept < broken):
        return "KEPT"
    return "BROKEN"


@pytest.mark.parametrize(
    "modules",
    [
        ("tokenfleet.sim.run", "tokenfleet.sim.fleet", "tokenfleet.fleet"),
        ("tokenfleet.fleet.router", "tokenfleet.fleet.autoscaler", "tokenfleet.fleet.leasing"),
        ("tokenfleet.core.scheduler", "tokenfleet.policy.admission"),
    ],
)
def test_the_simulator_and_the_bookkeeping_load_no_heavy_layer(modules: tuple[str, ...]) -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"print(sorted(set({HEAVY!r}) & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_at_most_six_modules_stay_at_the_top_of_the_package() -> None:
    top = sorted(p.name for p in (ROOT / "tokenfleet").glob("*.py"))
    assert top == ["__init__.py", "config.py", "envs.py", "errors.py", "llm.py"]


def test_a_module_over_400_lines_says_why_at_its_top() -> None:
    """STYLE.md's habit, held: one concept per module; a long one gives its reason in its
    docstring ("Over 400 lines: ...")."""
    unexplained = []
    for path in sorted((ROOT / "tokenfleet").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400 and "Over 400 lines" not in text.split('"""')[1]:
            unexplained.append(str(path.relative_to(ROOT)))
    assert unexplained == []


def _serve_commands_and_popens(path: Path) -> tuple[int, int]:
    """In `path`'s code (not its strings): the `tokenfleet serve` command lines (a list
    holding "tokenfleet.cli", "serve") and the calls to `subprocess.Popen`."""
    serves = popens = 0
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.List):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            serves += any(
                words[i : i + 2] == ["tokenfleet.cli", "serve"] for i in range(len(words))
            )
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            popens += node.func.attr == "Popen"
    return serves, popens


def test_tests_start_a_server_in_one_place() -> None:
    """A test's `tokenfleet serve` starts, is awaited and is stopped by
    tests/support/live_server.py; other tests only run the command to see it refuse."""
    tests = ROOT / "tests"
    support = tests / "support" / "live_server.py"
    assert _serve_commands_and_popens(support) == (1, 1)
    for path in tests.rglob("*.py"):
        serves, popens = _serve_commands_and_popens(path)
        if path != support and serves:
            assert popens == 0, path
