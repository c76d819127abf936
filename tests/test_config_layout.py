"""The config's file layout does not move with its stored shape (docs/design.md §2).

`TrainConfig` stores sections; the YAML files, `config.yaml`, training states, run-directory
names and the table's cache keys keep the flat layout of the original's configs. This test holds
what they were before the sections became the stored shape (tests/data/config_layout.json, made by
`python -m tests.test_config_layout` at that commit): the run-directory name of every shipped
config (alone and with overrides), the sha256 of its config.yaml and of its state's config, and the
cache key of every (table, row, metric) of experiments/paper. None of them is a number of a
machine: they are hashes of text, so they hold everywhere.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORED = os.path.join(REPO, "tests", "data", "config_layout.json")
# overrides that reach sections of every kind: a training key (run-dir hash), a run key, a key
# of a file section, an alias and a section nested in the file
OVERRIDES = (
    (),
    ("lr=0.01", "max_steps=7", "fp16=true"),
    ("attack.max_steps=3", "rand_seed=2", "eval.num_images=5", "robust_eval=false"),
    ("batch_size=64", "data.num_workers=0", "augm_type_generation=none", "use_ema=true",
     "clf_outdist_weight=0.1", "image_log.num_samples=7"),
)
FAKE_CHECKPOINT = "0" * 64
CHECKPOINT_ROOT = "/nonexistent/rebm-layout-checkpoints"
# The keys hold the absolute paths of the rows' relative data paths (a dataset root counts by its
# path): they are made from this folder, which holds only `experiments` (the tables' configs), so
# they depend neither on where the repository is nor on data a checkout has.
KEYS_CWD = os.path.join(tempfile.gettempdir(), "rebm-config-layout-cwd")


def shipped_configs():
    paths = [*glob.glob(os.path.join(REPO, "experiments", "*", "*.yaml")),
             *glob.glob(os.path.join(REPO, "InNOutRobustnessMean0_cifar100", "configs", "*.yaml"))]
    return sorted(os.path.relpath(p, REPO) for p in paths
                  if os.sep + "paper" + os.sep not in p)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def config_identities() -> dict:
    from rebm.config import default_run_dir, load_config, to_dict, to_yaml

    out = {}
    for path in shipped_configs():
        for overrides in OVERRIDES:
            cfg = load_config(os.path.join(REPO, path), overrides)
            out[f"{path} {' '.join(overrides)}".strip()] = {
                "run_dir": default_run_dir(path, overrides, to_dict(cfg)),
                "config_yaml": _sha(to_yaml(cfg)),
                "to_dict": _sha(json.dumps(to_dict(cfg), default=str)),  # key order included
            }
    return out


def table_keys() -> dict:
    shutil.rmtree(KEYS_CWD, ignore_errors=True)
    os.makedirs(KEYS_CWD)
    os.symlink(os.path.join(REPO, "experiments"), os.path.join(KEYS_CWD, "experiments"))
    with contextlib.chdir(KEYS_CWD):
        return _table_keys()


def _table_keys() -> dict:
    from rebm.eval.registry import metric_classes
    from rebm.eval.table.cache import FileHashes, metric_key
    from rebm.eval.table.spec import load_table, row_sections

    keys = {}
    for table in sorted(glob.glob(os.path.join(REPO, "experiments", "paper", "*.yaml"))):
        spec = load_table(table)
        configs = row_sections(spec, CHECKPOINT_ROOT)
        hashes = FileHashes()
        for row in spec.rows:
            for cls in metric_classes(spec.metrics):
                section = configs[row.name][cls.name]
                keys[f"{os.path.basename(table)} {row.name} {cls.name}"] = metric_key(
                    *_key_parts(section), cls, FAKE_CHECKPOINT, spec.batch_size, hashes)
    return keys


def _key_parts(section):
    """(evaluation section, model section) of what row_sections holds for a row and metric."""
    if hasattr(section, "evaluation"):  # a whole config (before the sections were stored)
        return section.evaluation, section.model
    return section, section.model


def current() -> dict:
    return {"configs": config_identities(), "table_keys": table_keys()}


@pytest.fixture(scope="module")
def stored():
    with open(STORED) as f:
        return json.load(f)


def test_run_dirs_config_yaml_and_states_keep_their_bytes(stored):
    now = config_identities()
    assert sorted(now) == sorted(stored["configs"]), "the shipped configs changed: regenerate"
    changed = {k: (stored["configs"][k], v) for k, v in now.items() if v != stored["configs"][k]}
    assert not changed, f"{len(changed)} layouts moved, e.g. {next(iter(changed.items()))}"


@pytest.mark.slow
def test_every_table_cache_key_is_the_same(stored):
    now = table_keys()
    assert len(now) == len(stored["table_keys"]) >= 200
    moved = [k for k, v in now.items() if stored["table_keys"].get(k) != v]
    assert not moved, f"{len(moved)} cache keys moved, e.g. {moved[:3]}"


if __name__ == "__main__":  # regenerate: only at a commit whose layout is the reference
    sys.path.insert(0, REPO)
    with open(STORED, "w") as f:
        json.dump(current(), f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {STORED}")
