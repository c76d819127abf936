"""The `slow` tier `make test-fast` leaves out is marked at each test (`@pytest.mark.slow`, or a
file's `pytestmark`). The guard: every test that starts a training run is marked, so the fast
tier stays fast; and the files conftest.py starts first exist. The `numbers` tier `make
test-dispatch` reruns under a forced CPU dispatch holds every file that reads stored numbers,
and that dispatch is in effect."""

import ast
import os
import re

import pytest

from tests.conftest import LONGEST_FIRST
from tests.dispatch import aten_capability, mismatches
from tests.helpers import REPO

# Calls that start a training run (tests.helpers.run_train; test_stage1's command builders), and
# conftest.py's session fixture that runs two of them.
STARTS_A_RUN = {"run_train", "stage1_cmd", "spawn_cmd"}
RUN_FIXTURES = {"straight"}


def _is_slow(decorators) -> bool:
    return any("mark.slow" in ast.unparse(d) for d in decorators)


def _file_marks(tree: ast.Module, mark: str) -> bool:
    return any(isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node.targets[0])
               and f"mark.{mark}" in ast.unparse(node.value) for node in tree.body)


def _file_is_slow(tree: ast.Module) -> bool:
    return _file_marks(tree, "slow")


def _calls(node: ast.AST) -> set:
    return {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", "")
            for c in ast.walk(node) if isinstance(c, ast.Call)}


def _unmarked_tests_that_start_runs(tree: ast.Module) -> list:
    """Tests of a module that start a training run themselves, through a function or fixture
    of the same module, or through a run fixture, and are not marked slow."""
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    reached = {name: _calls(node) for name, node in functions.items()}
    for name in reached:  # follow the module's own helpers and fixtures to a fixed point
        pending = list(reached[name])
        while pending:
            callee = pending.pop()
            for inner in reached.get(callee, set()) - reached[name]:
                reached[name].add(inner)
                pending.append(inner)
    found = []
    for name, node in functions.items():
        if not name.startswith("test_") or _is_slow(node.decorator_list):
            continue
        uses = set(reached[name])
        for arg in node.args.args:
            uses |= reached.get(arg.arg, set())
            if arg.arg in RUN_FIXTURES:
                uses.add("run_train")
        if uses & STARTS_A_RUN:
            found.append(name)
    return found


def test_every_test_that_starts_a_training_run_is_marked_slow():
    unmarked = {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        if not _file_is_slow(tree):
            names = _unmarked_tests_that_start_runs(tree)
            if names:
                unmarked[path.name] = names
    assert not unmarked, f"mark these @pytest.mark.slow (make test-fast must stay fast): {unmarked}"


def test_the_guard_sees_an_unmarked_run():
    tree = ast.parse("import pytest\n\n"
                     "def helper(tmp):\n    return run_train(['c'], run_dir=tmp)\n\n"
                     "def test_direct(tmp_path):\n    helper(tmp_path)\n\n"
                     "def test_by_fixture(straight):\n    pass\n\n"
                     "@pytest.mark.slow\ndef test_marked(tmp_path):\n    helper(tmp_path)\n")
    assert _unmarked_tests_that_start_runs(tree) == ["test_direct", "test_by_fixture"]
    assert _file_is_slow(ast.parse("import pytest\npytestmark = [pytest.mark.slow]\n"))


def test_the_files_started_first_exist():
    assert all((REPO / path).exists() for path in LONGEST_FIRST), LONGEST_FIRST


# --------------------------------------------------------------------------------------------
# The `numbers` tier `make test-dispatch` reruns under a forced lower CPU dispatch
# --------------------------------------------------------------------------------------------
STORED = ("data_states",)  # folders of tests/ holding numbers computed on another machine
EXACT = re.compile(r"torch\.equal\(|array_equal\(|assert_close\(|allclose\(")


def test_every_file_that_reads_stored_numbers_is_marked_numbers():
    """A test that compares with numbers computed elsewhere is what a forced dispatch must
    rerun (docs/design.md §7, storing a reference)."""
    unmarked = [path.name for path in sorted((REPO / "tests").glob("test_*.py"))
                if path.name != "test_suite_tiers.py"
                and any(folder in path.read_text() for folder in STORED)
                and not _file_marks(ast.parse(path.read_text()), "numbers")]
    assert not unmarked, f"mark these files pytest.mark.numbers: {unmarked}"


def test_every_file_that_compares_numbers_has_tests_marked_numbers():
    """A file that compares tensors exactly or within a tolerance has its comparing tests (or
    itself) marked, so `make test-dispatch` reruns them (a guard for new files; which tests of
    a file compare is the author's to mark)."""
    unmarked = [path.name for path in sorted((REPO / "tests").glob("test_*.py"))
                if EXACT.search(path.read_text()) and "mark.numbers" not in path.read_text()]
    assert not unmarked, f"mark the tests of these files that compare numbers: {unmarked}"


@pytest.mark.numbers
def test_the_cpu_dispatch_asked_for_is_in_effect():
    """Under `make test-dispatch` ATen and oneDNN run the forced level; without a forcing
    variable they report the machine's own (ATen ignores an unknown value without a word)."""
    assert mismatches(dict(os.environ)) == []
    assert aten_capability() in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256", "SVE"}
