"""The `_all_ranks` rule (docs/design.md §3, "Collectives in plain sight"), checked over the code's
call graph (tests/call_graph.py), as tests/test_layout.py checks lengths and import-linter the
layers: a function outside rebm/distributed/ that reaches a torch.distributed collective through
the calls the code names ends in `_all_ranks`, or is exempt. The calls it cannot follow
(callbacks, parameters, hooks) are checked when they run, in every process the suite starts
(tests/collective_guard.py); both halves are shown to catch a planted violation here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Dict, List, Set

import pytest

from tests import collective_guard
from tests.call_graph import ANY, CallGraph
from tests.helpers import REPO, base_env

FOLDERS = ("rebm", "InNOutRobustnessMean0_cifar100")
OWN = "rebm.distributed."  # the collectives' own package: exempt, the rule's ground


def _qualified(path: str, qualname: str) -> str:
    return ".".join([*Path(path).with_suffix("").parts, qualname])


def exemptions() -> Set[str]:
    return {_qualified(path, qualname) for path, qualname in collective_guard.EXEMPT}


def violations(graph: CallGraph, exempt: Set[str]) -> List[str]:
    """One line per function that breaks the rule: where it is, and a path to a collective."""
    lines = []
    for name, trail in sorted(graph.reaching(stops=exempt).items()):
        function = graph.functions[name]
        if name.startswith(OWN) or name in exempt or function.short.rpartition(".")[2].endswith(
                collective_guard.SUFFIX):
            continue
        shown = [step.replace(ANY, "<object>.") for step in trail]
        lines.append(f"{function.path.relative_to(graph.root)}:{function.line} {function.short} "
                     f"reaches a collective without ending in {collective_guard.SUFFIX}: "
                     + " -> ".join(shown))
    return lines


def test_functions_that_reach_a_collective_end_in_all_ranks():
    graph = CallGraph(REPO, FOLDERS)
    found = violations(graph, exemptions())
    assert not found, "\n".join(["functions that reach a collective must end in _all_ranks "
                                 "(docs/design.md §3, \"Collectives in plain sight\"):", *found])


def test_every_exemption_names_a_function_that_exists():
    graph = CallGraph(REPO, FOLDERS)
    listed = exemptions()
    assert listed <= set(graph.functions), sorted(listed - set(graph.functions))


def _planted(tmp_path: Path, files: Dict[str, str]) -> CallGraph:
    for name, text in files.items():
        path = tmp_path / "rebm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return CallGraph(tmp_path, ("rebm",))


def test_the_call_graph_names_a_planted_violation_and_its_path(tmp_path):
    graph = _planted(tmp_path, {
        "__init__.py": "",
        "distributed/__init__.py": "",
        "distributed/collectives.py": """
            import torch.distributed as dist

            def all_reduce_sum(runtime, tensor):
                dist.all_reduce(tensor)
            """,
        "eval/passes.py": """
            from rebm.distributed.collectives import all_reduce_sum

            class Pass:
                def finish(self):
                    return helper(self.runtime)

                def total_all_ranks(self):
                    return self.finish()

            def helper(runtime):
                return all_reduce_sum(runtime, 1)

            def caller(obj):
                return obj.count_all_ranks()
            """})
    found = violations(graph, set())
    assert found == [
        "rebm/eval/passes.py:5 Pass.finish reaches a collective without ending in _all_ranks: "
        "rebm.eval.passes.Pass.finish -> rebm.eval.passes.helper -> "
        "rebm.distributed.collectives.all_reduce_sum -> torch.distributed.all_reduce",
        "rebm/eval/passes.py:14 caller reaches a collective without ending in _all_ranks: "
        "rebm.eval.passes.caller -> <object>.count_all_ranks",
        "rebm/eval/passes.py:11 helper reaches a collective without ending in _all_ranks: "
        "rebm.eval.passes.helper -> rebm.distributed.collectives.all_reduce_sum -> "
        "torch.distributed.all_reduce"], found


def _run_in(path: str, source: str, namespace: Dict) -> None:
    """Run `source` as if it were the repository's file `path` (its frames carry that name)."""
    exec(compile(textwrap.dedent(source), str(REPO / path), "exec"), namespace)


def test_the_guard_names_a_collective_reached_outside_all_ranks(monkeypatch, tmp_path):
    monkeypatch.setenv(collective_guard.ENV, str(tmp_path))
    monkeypatch.setattr(collective_guard, "_SEEN", set())
    calls = []
    dist = types.SimpleNamespace(all_reduce=lambda tensor: calls.append(tensor))
    collective_guard.install(dist)
    namespace = {"dist": dist}
    _run_in("rebm/distributed/planted.py", """
        def all_reduce_sum(x):
            dist.all_reduce(x)
        """, namespace)
    _run_in("rebm/eval/planted.py", """
        def callback(x):
            all_reduce_sum(x)

        def hand_over(fn, x):
            fn(x)

        def total_all_ranks(x):
            hand_over(callback, x)  # the call graph cannot see through `fn`

        def direct_all_ranks(x):
            all_reduce_sum(x)
        """, namespace)
    namespace["direct_all_ranks"](1)
    assert collective_guard.violations() == []
    namespace["total_all_ranks"](3)
    assert calls == [1, 3]  # the collective still runs: a violation never becomes a hang
    found = collective_guard.violations()
    assert len(found) == 1, found
    assert found[0].startswith(
        "rebm/eval/planted.py:3 callback reached torch.distributed.all_reduce without ending in "
        "_all_ranks (nor exempt); stack: "), found
    assert found[0].endswith(
        "rebm/eval/planted.py:9 total_all_ranks -> rebm/eval/planted.py:6 hand_over -> "
        "rebm/eval/planted.py:3 callback -> rebm/distributed/planted.py:3 all_reduce_sum"), found


def test_the_guard_is_on_in_the_processes_the_tests_start():
    """A new interpreter with the tests' environment (even one that sets its own PYTHONPATH)
    waits for torch.distributed with the guard's finder; importing it wraps the collectives
    (tests/test_eval.py and the others then run under it)."""
    env = base_env(1, {"PYTHONPATH": str(REPO)})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == collective_guard.SITE
    assert env.get(collective_guard.ENV)
    probe = "import sys; print(*[type(f).__name__ for f in sys.meta_path])"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert out.stdout.split()[0] == "_Finder", out.stdout + out.stderr
    import torch.distributed as dist  # the pytest process: conftest installed it

    assert getattr(dist.all_reduce, "__guarded__", False)
    assert getattr(dist._verify_params_across_processes, "__guarded__", False)


@pytest.mark.parametrize("qualname", ["Trainer.fit", "x.<locals>.gather_all_ranks"])
def test_exempt_frames(qualname):
    assert collective_guard.exempt("rebm/engine/trainer.py", qualname)
    assert not collective_guard.exempt("rebm/engine/trainer.py", "Trainer.build")
    assert not collective_guard.exempt("rebm/training/train.py", "run")  # a body says what it does
