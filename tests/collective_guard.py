"""The run-time half of the `_all_ranks` rule (docs/design.md §3, "Collectives in plain sight";
the static half is tests/test_all_ranks_rule.py, over the call graph).

In every process the tests start, each torch.distributed collective first looks at the stack: the
innermost frame of the repository's code outside rebm/distributed/ (the collectives' own module)
must be a function whose name ends in `_all_ranks`, or an exempt one (`EXEMPT`).
So a collective reached through a callback or a parameter (a metric's hook, a function handed to
`decide_on_main`), which the call graph cannot follow, is caught when it runs. Frames of the tests'
own code end the search: a test may call a collective helper itself. A violation is appended to a
file in the folder $REBM_COLLECTIVE_GUARD, and tests/conftest.py fails the test that was running,
naming the function and the stack; the process carries on as it would have, so a violation never
becomes a hang in the test that finds it.

tests/guard_site/sitecustomize.py installs this in every interpreter the tests start (its folder
is on the PYTHONPATH that tests.helpers.base_env gives), when torch.distributed is imported, and
tests/conftest.py in the pytest process; production code knows nothing of it. Standard library
only: it loads before anything else."""

from __future__ import annotations

import functools
import importlib.machinery
import os
import sys
from types import FrameType, ModuleType
from typing import Callable, Dict, Optional, Tuple

ENV = "REBM_COLLECTIVE_GUARD"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(REPO, "tests", "guard_site")
CHECKED = tuple(os.path.join(REPO, folder) + os.sep
                for folder in ("rebm", "InNOutRobustnessMean0_cifar100"))
OWN = os.path.join(REPO, "rebm", "distributed") + os.sep
TESTS = os.path.join(REPO, "tests") + os.sep
SUFFIX = "_all_ranks"

# torch.distributed's functions that every rank of the group must call: a rank that skips one
# leaves the others waiting. tests/call_graph.py reads the same list.
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "gather",
    "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "all_reduce_coalesced",
    "all_gather_coalesced", "new_group"})
# DistributedDataParallel's construction checks the parameters' shapes on every rank (then
# broadcasts them); its forward and backward collectives belong to the step that runs the model.
CONSTRUCTION = ("_verify_params_across_processes",)

# (file, qualified name) of the functions exempt besides the suffix (docs/design.md §3): the
# entry points every rank runs from the start, and the original DAT's `get_model`, whose name
# scripts written against the original import (it builds DDP when use_ddp). An entry's body
# (handed to rebm.cli.run_entry or launch) ends in `_all_ranks` itself: every rank runs it.
EXEMPT = frozenset({
    ("rebm/engine/trainer.py", "train"),
    ("rebm/engine/trainer.py", "Trainer.__init__"),
    ("rebm/engine/trainer.py", "Trainer.fit"),
    ("rebm/training/modeling.py", "get_model"),
})
_INLINE = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


def exempt(path: str, qualname: str) -> bool:
    """`path` relative to the repository, `qualname` as Python writes it (Class.method,
    outer.<locals>.inner)."""
    return qualname.rpartition(".")[2].endswith(SUFFIX) or (path, qualname) in EXEMPT


_PATHS: Dict[str, str] = {}


def _path(code) -> str:
    path = _PATHS.get(code.co_filename)
    if path is None:
        path = _PATHS[code.co_filename] = os.path.abspath(code.co_filename)
    return path


def verdict(frame: Optional[FrameType]) -> Optional[Tuple[str, str]]:
    """None when the call from `frame` outwards keeps the rule, else (the function to blame as
    path:line qualname, the repository's frames of the stack, outermost first)."""
    blamed, trail = None, []
    while frame is not None:
        code = frame.f_code
        path = _path(code)
        if path.startswith(TESTS) and blamed is None:
            return None
        if path.startswith(CHECKED) or path.startswith(TESTS):
            relative = os.path.relpath(path, REPO)
            qualname = getattr(code, "co_qualname", code.co_name)
            trail.append(f"{relative}:{frame.f_lineno} {qualname}")
            if blamed is None and not path.startswith(OWN) and code.co_name not in _INLINE:
                if exempt(relative, qualname):
                    return None
                blamed = f"{relative}:{frame.f_lineno} {qualname}"
        frame = frame.f_back
    if blamed is None:
        return None
    return blamed, " -> ".join(reversed(trail))


_SEEN: set = set()


def _record(name: str, found: Tuple[str, str]) -> None:
    folder = os.environ.get(ENV)
    if not folder or (name, found[0]) in _SEEN:
        return
    _SEEN.add((name, found[0]))
    line = (f"{found[0]} reached torch.distributed.{name} without ending in {SUFFIX} (nor "
            f"exempt); stack: {found[1]}")
    try:
        with open(os.path.join(folder, f"violations-{os.getpid()}.txt"), "a") as fh:
            fh.write(line + "\n")
    except OSError:
        print(f"collective guard: {line}", file=sys.stderr, flush=True)


def _guarded(name: str, collective: Callable) -> Callable:
    @functools.wraps(collective)
    def guarded(*args, **kwargs):
        found = verdict(sys._getframe(1))
        if found is not None:
            _record(name, found)
        return collective(*args, **kwargs)

    guarded.__guarded__ = True
    return guarded


def install(namespace) -> None:
    """Wrap the collectives of `namespace` (torch.distributed, or a stand-in in a test)."""
    for name in (*sorted(COLLECTIVES), *CONSTRUCTION):
        collective = getattr(namespace, name, None)
        if collective is not None and not getattr(collective, "__guarded__", False):
            setattr(namespace, name, _guarded(name, collective))


class _Finder:
    """Wraps torch.distributed's collectives as soon as torch.distributed is imported (importing
    torch here would slow every interpreter the tests start)."""

    def find_spec(self, name: str, path, target=None):
        if name != "torch.distributed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            install(module)

        spec.loader.exec_module = exec_module
        return spec

    def invalidate_caches(self) -> None:
        pass


def install_when_imported() -> None:
    module = sys.modules.get("torch.distributed")
    if module is not None:
        install(module)
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def violations() -> list:
    """The violations recorded since the last call (their files are removed)."""
    folder, found = os.environ.get(ENV), []
    if folder and os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            with open(path) as fh:
                found += fh.read().splitlines()
            os.unlink(path)
    return found


def environment(env: Dict[str, str]) -> Dict[str, str]:
    """`env` with the guard's folder on its PYTHONPATH, when the guard is on (REBM_COLLECTIVE_GUARD
    set): the interpreters it starts install the guard."""
    if env.get(ENV):
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE]
        env["PYTHONPATH"] = os.pathsep.join([SITE, *paths])
    return env
