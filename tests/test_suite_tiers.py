"""The `slow` tier `make test-fast` leaves out: the tests conftest.py marks by name exist (a
renamed test would otherwise silently join the fast tier); so do the files it starts first."""

import ast

from tests.conftest import LONGEST_FIRST, SLOW_FILES, SLOW_TESTS
from tests.helpers import REPO


def test_every_test_marked_slow_by_name_exists():
    assert all((REPO / path).exists() for path in SLOW_FILES), SLOW_FILES
    for path, names in SLOW_TESTS.items():
        tree = ast.parse((REPO / path).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert names <= defined, (path, names - defined)


def test_the_files_started_first_exist():
    assert all((REPO / path).exists() for path in LONGEST_FIRST), LONGEST_FIRST
