"""Components take the config section they read, not the whole config (docs/design.md §2).

A function reaches the whole config when it has a parameter named `cfg` (or annotated with
TrainConfig), or reads an attribute named `cfg` (`self.cfg`, `ctx.cfg`: a context object that
carries it). The config package itself, the entry points (each command's `run` and the checks
it runs before, cli's `--check` and config summary), `train`, `Trainer.__init__` and the builder
of a run's parts (from six sections) reach it; everything else takes its section
(`cfg.schedule`, `cfg.run`, `cfg.data`, ...: rebm/config/sections.py). The count may only go down: a new function that takes the whole
config fails here, naming it.
"""

from __future__ import annotations

import ast

from rebm.config import TrainConfig
from rebm.config.sections import gather
from tests.helpers import REPO

CEILING = 31  # functions in rebm/ that reach the whole config (216 before the sections)
WHOLE = "TrainConfig"


def _reaches_whole_config(node: ast.AST) -> bool:
    args = node.args
    params = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    for param in params:
        annotation = ast.unparse(param.annotation) if param.annotation is not None else ""
        if param.arg == "cfg" or WHOLE in annotation:
            return True
    return any(isinstance(inner, ast.Attribute) and inner.attr == "cfg" for inner in ast.walk(node))


def whole_config_functions():
    found = []
    for path in sorted((REPO / "rebm").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _reaches_whole_config(node):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    return found


def test_few_functions_reach_the_whole_config():
    found = whole_config_functions()
    assert len(found) <= CEILING, (
        f"{len(found)} functions reach the whole config (ceiling {CEILING}); pass the section "
        "instead (rebm/config/sections.py):\n" + "\n".join(found))


def test_the_counter_sees_each_way_of_reaching_it():
    source = (
        "def a(cfg): pass\n"
        "def b(config: TrainConfig): pass\n"
        "def c(self): return self.cfg.lr\n"
        "def d(ctx): return ctx.cfg\n"
        "def e(schedule): return schedule.lr\n")
    hits = [n.name for n in ast.parse(source).body if _reaches_whole_config(n)]
    assert hits == ["a", "b", "c", "d"]


def test_a_section_holds_the_config_values_it_names(tmp_path):
    cfg = TrainConfig(lr=0.25, run_dir=str(tmp_path), keep_last_states=7)
    assert cfg.schedule.lr == 0.25 and cfg.run.run_dir == str(tmp_path)
    assert cfg.run.keep_last_states == 7 and cfg.evaluation.eval is cfg.eval
    assert gather(type(cfg.run), cfg) == cfg.run
