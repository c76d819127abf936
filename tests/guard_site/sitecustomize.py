"""Loaded at the start of every interpreter the tests start (tests.helpers.base_env puts this
folder on PYTHONPATH): the `_all_ranks` rule's run-time check, tests/collective_guard.py, wraps
torch.distributed's collectives once it is imported. Only with REBM_COLLECTIVE_GUARD set (by
tests/conftest.py); the guard module is loaded by its path, so sys.path stays as it was."""

import importlib.util
import os
import sys

if os.environ.get("REBM_COLLECTIVE_GUARD") and "tests.collective_guard" not in sys.modules:
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "collective_guard.py")
    _spec = importlib.util.spec_from_file_location("tests.collective_guard", _path)
    _guard = sys.modules["tests.collective_guard"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_guard)
    _guard.install_when_imported()
