"""The `slow` tier `make test-fast` leaves out: the tests conftest.py marks by name exist (a
renamed test would otherwise silently join the fast tier)."""

import ast

from tests.conftest import MULTI_PROCESS_TESTS
from tests.helpers import REPO


def test_every_test_marked_slow_by_name_exists():
    for path, names in MULTI_PROCESS_TESTS.items():
        tree = ast.parse((REPO / path).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert names <= defined, (path, names - defined)
