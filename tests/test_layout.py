"""The code layout stays as docs/design.md §6 describes it: layers import downwards only
(import-linter contracts in pyproject.toml), and files and functions stay short."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

MAX_FILE_LINES = 600  # one concern per file; split by giving state an owner, not by length
MAX_FUNCTION_LINES = 80
CHECKED = ("rebm", "InNOutRobustnessMean0_cifar100", "tests", "benchmarks")


def test_layers_import_downwards_only():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint_imports)], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def _python_files():
    for folder in CHECKED:
        yield from sorted((REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", list(_python_files()), ids=lambda p: str(p.relative_to(REPO)))
def test_files_and_functions_stay_short(path):
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_FILE_LINES, f"{path}: over {MAX_FILE_LINES} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


def test_no_file_refers_outside_the_repository():
    offenders = []
    for path in REPO.rglob("*"):
        if (path.suffix not in (".py", ".md", ".yaml", ".toml") and path.name != "Makefile") \
                or any(part.startswith(".") for part in path.relative_to(REPO).parts):
            continue
        if "shared/" + "DESIGN" in path.read_text(errors="ignore"):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders
