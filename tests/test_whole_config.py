"""Components take the config section they read, not the whole config (docs/design.md §2).

A function reaches the whole config when a parameter is typed `TrainConfig` or named `cfg`, when
it reads an attribute named `cfg` (`self.cfg`: an object that carries it), when it returns one
or makes one (`load_config`, `parse_and_load`, `TrainConfig(...)`). Counted by type, not by
name alone. Each function that still reaches it is named below with why; a new one fails here,
naming it, and so does one that no longer does (take it off the list).
"""

from __future__ import annotations

import ast

from rebm.config import TrainConfig
from tests.helpers import REPO

WHOLE = "TrainConfig"
MAKERS = {"load_config", "TrainConfig", "parse_and_load"}
# function -> why it holds the whole config. The entry points: each command reads the config it
# was given and hands out sections; the config package reads its own type.
REACHES_IT = {
    "rebm/cli.py parse_and_load": "every entry point loads its config here",
    "rebm/cli.py run_entry": "runs an entry point on the config it loaded",
    "rebm/cli.py print_config_and_plan": "--check: validates and prints every section",
    "rebm/cli.py config_summary": "--check: the summary names keys of every section",
    "rebm/cli.py environment_warnings": "--check: data folders, devices and the backend",
    "rebm/cli.py memory_plan_lines": "--check: the memory plan reads the model, batches, "
                                     "optimizer, EMA and precision",
    "rebm/training/train.py train_dat_all_ranks": "the training entry point",
    "rebm/training/train.py check_dat": "stage 2's --check",
    "rebm/training/train.py make_training_method": "builds the method from its three sections",
    "rebm/engine/trainer.py train": "one engine owns a run: it resolves the run directory",
    "rebm/engine/trainer.py Trainer.__init__": "one engine owns a run: it hands out the sections",
    "rebm/engine/parts.py build_parts_all_ranks": "the run's parts from six sections",
    "rebm/eval/commands/evaluate.py evaluate_command_all_ranks": "the evaluation entry point",
    "rebm/eval/commands/evaluate.py check_metrics": "the evaluation entry point's checks",
    "rebm/eval/commands/class_stats.py class_stats_all_ranks": "the class statistics entry point",
    "rebm/eval/commands/fid_stats.py fid_stats_all_ranks": "the FID statistics entry point",
    "rebm/eval/commands/fid_stats.py check_args": "the FID statistics entry point's checks",
    "rebm/eval/table/spec.py _row_config": "loads a row's config, naming the overrides that "
                                           "broke it; the table keeps its section only",
    "rebm/eval/table/paths.py rooted_config": "moves a loaded row config's data paths before "
                                              "its section is taken",
}


def _params(node) -> list:
    args = node.args
    return args.posonlyargs + args.args + args.kwonlyargs + [
        a for a in (args.vararg, args.kwarg) if a]


def _reaches_whole_config(node: ast.AST) -> bool:
    for param in _params(node):
        annotation = ast.unparse(param.annotation) if param.annotation is not None else ""
        if param.arg == "cfg" or WHOLE in annotation:
            return True
    if node.returns is not None and WHOLE in ast.unparse(node.returns):
        return True
    for inner in ast.walk(node):
        if isinstance(inner, ast.Attribute) and inner.attr == "cfg":
            return True
        if isinstance(inner, ast.Call):
            name = inner.func.attr if isinstance(inner.func, ast.Attribute) else getattr(
                inner.func, "id", "")
            if name in MAKERS:
                return True
    return False


def whole_config_functions():
    found = []
    for path in sorted((REPO / "rebm").rglob("*.py")):
        if path.parent.name == "config" and path.parent.parent.name == "rebm":
            continue  # the config package reads its own type
        if path.parent.name == "standin" and path.parent.parent.name == "rebm":
            # an entry point over whole recipes: it shrinks a recipe by keys of every section
            # and lists every file a real run of it reads, as `--check` does
            continue
        tree = ast.parse(path.read_text())
        for cls_or_mod in [tree, *[n for n in tree.body if isinstance(n, ast.ClassDef)]]:
            prefix = f"{cls_or_mod.name}." if isinstance(cls_or_mod, ast.ClassDef) else ""
            for node in cls_or_mod.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        _reaches_whole_config(node):
                    found.append(f"{path.relative_to(REPO)} {prefix}{node.name}")
    return found


def test_only_the_named_functions_reach_the_whole_config():
    found = set(whole_config_functions())
    new, gone = sorted(found - set(REACHES_IT)), sorted(set(REACHES_IT) - found)
    assert not new, ("these functions reach the whole config; pass the section instead "
                     "(rebm/config/sections.py), or name them here with why:\n" + "\n".join(new))
    assert not gone, "these no longer reach the whole config; take them off:\n" + "\n".join(gone)


def test_the_counter_sees_each_way_of_reaching_it():
    source = (
        "def a(cfg): pass\n"
        "def b(config: TrainConfig): pass\n"
        "def c(self): return self.cfg.optimization.lr\n"
        "def d(ctx): return ctx.cfg\n"
        "def e(path) -> TrainConfig: pass\n"
        "def f(path): return load_config(path)\n"
        "def g(schedule): return schedule.batch_size\n")
    hits = [n.name for n in ast.parse(source).body if _reaches_whole_config(n)]
    assert hits == ["a", "b", "c", "d", "e", "f"]


def test_a_section_holds_each_key_once():
    """Every leaf of the stored sections is one key of the file, and every file key one leaf."""
    from rebm.config.layout import FILE_LAYOUT, file_leaves

    leaves = list(file_leaves(TrainConfig()))
    assert len({stored for _, stored, *_ in leaves}) == len(leaves)
    assert len({key for key, *_ in leaves}) == len(leaves)
    assert len({key for key, _ in FILE_LAYOUT}) == len({path for _, path in FILE_LAYOUT}) \
        == len(FILE_LAYOUT)
    cfg = TrainConfig()
    assert cfg.evaluation.eval is cfg.eval and cfg.evaluation.schedule is cfg.schedule
    assert cfg.evaluation == TrainConfig().evaluation  # views compare by value


def test_no_engine_function_takes_more_than_five_parameters():
    """The engine passes sections and owners of state, not long lists (self and cls apart)."""
    long = []
    for path in sorted((REPO / "rebm" / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [p.arg for p in _params(node) if p.arg not in ("self", "cls")]
                if len(names) > 5:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}{names}")
    assert not long, "\n".join(long)
