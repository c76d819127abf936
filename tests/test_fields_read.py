"""No config key loads and does nothing: every field of every config section is read by the code
of a training stage, unless it is one of the original's keys declared without effect
(rebm/compat/config_fields.py) or declared below as read only on a path a short run cannot take.

The reads are recorded in this process: `__getattribute__` of each section class is wrapped while
the real entry points (stage 1's InNOutRobustnessMean0_cifar100/train_at.py, stage 2's
rebm.training.train) each train two steps and evaluate once, in process, on the tests' stand-in
data, with fields set away from their defaults where code reads a field only when another is set
(use_ema, adaptive_steps, the extra metrics, TinyImages' exclusion lists, ...). A read counts when
it comes from rebm's code outside the config layer, which loads, validates and serialises every
field (rebm/config, rebm/compat), or from the batch plan (rebm/config/batch.py), which sizes the
run. The runs are shared by the tests (a module fixture): about 20 s on a 2-core machine."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections import defaultdict
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Dict, List, Set, Tuple

import numpy as np
import pytest

from rebm.compat.config_fields import KEYS_WITHOUT_EFFECT
from rebm.config import IGNORED_FIELDS, RUN_KEYS, TrainConfig, explicit_keys, load_config
from rebm.config.identity import VALUE_BEFORE_THE_KEY
from rebm.config.layout import file_keys, file_leaves
from rebm.config.sections import MethodSection
from rebm.eval.standin import SPEC as STANDIN_SPEC
from rebm.methods.stages import DAT_ONLY_KEYS, STAGE1, STAGE1_METHOD_KEYS
from rebm.standin.writers import (
    write_fake_cifar10,
    write_fake_openimage_o,
    write_tiny_images,
    write_tinyimages_exclusion_lists,
)
from tests.helpers import REPO, TRAINING_CONFIGS
from tests.standins import write_standin_statistics

SectionField = Tuple[int, str]  # (id of a section object, field name)

# Fields a short run on the tests' data cannot read: the field's file key -> (the code that reads
# it, as module:qualname, whose source names the field; why the run cannot go there).
READ_ONLY_ON: Dict[str, Tuple[str, str]] = {
    "image_log.unverified_inception": (
        "rebm.eval.features.network:feature_network",
        "read only when the feature metrics use an Inception weights file, not the stand-in of "
        "REBM_FID_FEATURES; no such file can be downloaded here (tests/test_inception_file.py "
        "checks that path in its own processes)"),
}

# Keys a shipped config sets although its stage does not read them: (stage, file key) -> why.
SET_BUT_UNREAD_BY_STAGE: Dict[Tuple[int, str], str] = {
    (1, "augm_type_generation"): "stage 1 loads the classifier stream only; the stage-1 configs "
                                 "keep the key so that states of earlier runs resume under the "
                                 "same config",
}

STAGE1_CIFAR10 = REPO / "InNOutRobustnessMean0_cifar100" / "configs" / "cifar10_wrn34x10.yaml"
STAGE1_CONFIGS = sorted((REPO / "InNOutRobustnessMean0_cifar100" / "configs").glob("*.yaml"))
SHIPPED = [(1 if "stage1" in p.name else 2, p) for p in TRAINING_CONFIGS] + \
    [(1, p) for p in STAGE1_CONFIGS]
SHORT = ["max_steps=2", "batch_size=17", "indist_attack_clf.max_steps=1", "robust_eval_steps=1",
         "n_imgs_per_evaluation_log=34", "n_imgs_per_metrics_log=17", "n_imgs_per_ckpt_save=17",
         "n_imgs_per_image_log=17", "data.num_workers=0"]


def section_classes() -> List[type]:
    """TrainConfig and every section class in it (each once)."""
    found: List[type] = []

    def walk(cls: type) -> None:
        found.append(cls)
        for f in fields(cls):
            if f.default_factory is not MISSING:
                value = f.default_factory()
                if is_dataclass(value) and type(value) not in found:
                    walk(type(value))

    walk(TrainConfig)
    return found


def counts_as_use(filename: str) -> bool:
    if filename == str(REPO / "rebm" / "config" / "batch.py"):
        return True
    config_layer = (str(REPO / "rebm" / "config") + os.sep, str(REPO / "rebm" / "compat") + os.sep)
    ours = (str(REPO / "rebm") + os.sep, str(REPO / "InNOutRobustnessMean0_cifar100") + os.sep)
    return filename.startswith(ours) and not filename.startswith(config_layer)


class ReadRecorder:
    """Records which fields of which section objects rebm's code reads while `stage` is set,
    and every config (TrainConfig) read from, so that each read is named by its file key
    (`attack.start_step` and `indist_attack_clf.start_step` are one class's field)."""

    def __init__(self, classes: List[type]):
        self.classes = classes
        self.reads: Dict[int, Set[SectionField]] = defaultdict(set)
        self.objects: Dict[int, object] = {}  # kept alive, so that no id is reused
        self.configs: Dict[int, TrainConfig] = {}
        self.stage = None

    def install(self) -> None:
        for cls in self.classes:
            assert "__getattribute__" not in cls.__dict__, cls
            cls.__getattribute__ = self._wrapper(cls)

    def remove(self) -> None:
        for cls in self.classes:
            del cls.__getattribute__

    def _wrapper(self, cls: type):
        names, recorder = {f.name for f in fields(cls)}, self

        def getattribute(obj, name):
            if name in names and recorder.stage is not None:
                if cls is TrainConfig:
                    recorder.configs[id(obj)] = obj
                if counts_as_use(sys._getframe(1).f_code.co_filename):
                    recorder.objects[id(obj)] = obj
                    recorder.reads[recorder.stage].add((id(obj), name))
            return object.__getattribute__(obj, name)

        return getattribute

    def keys_read(self) -> Dict[int, Set[str]]:
        """{stage: the file keys of the leaf fields its runs read}. A section object of no
        config (a copy made by code, e.g. robust evaluation's attack) stands for the config's
        section of its class it differs from in the fewest fields."""
        where: Dict[SectionField, str] = {}
        owners: Dict[type, List[object]] = defaultdict(list)
        for cfg in self.configs.values():
            for key, _, owner, f in file_leaves(cfg):
                where[(id(owner), f.name)] = key
                owners[type(owner)].append(owner)
        for obj_id, obj in self.objects.items():
            if not any(id(owner) == obj_id for owner in owners[type(obj)]):
                for name in {f.name for f in fields(obj)}:
                    where[(obj_id, name)] = where[(id(closest(obj, owners[type(obj)])), name)]
        return {stage: {where[read] for read in reads if read in where}
                for stage, reads in self.reads.items()}


def closest(obj: object, candidates: List[object]) -> object:
    def same(other: object) -> int:
        return sum(object.__getattribute__(obj, f.name) == object.__getattribute__(other, f.name)
                   for f in fields(obj))

    return max(candidates, key=same)


def run_entry(recorder: ReadRecorder, stage: int, argv: List[str]) -> None:
    if stage == 1:
        from InNOutRobustnessMean0_cifar100.train_at import main
    else:
        from rebm.training.train import main
    recorder.stage = stage
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    finally:
        recorder.stage = None
    assert code in (0, None), f"{argv}: exit {code}"


def write_inputs(root: Path) -> None:
    write_fake_cifar10(str(root / "CIFAR10"), n_train=60, n_test=21)
    write_tiny_images(str(root / "tiny_images.bin"), n_records=200)
    write_tinyimages_exclusion_lists(str(root / "exclusion"), 200)
    np.save(root / "excluded.npy", np.array([3, 5]))
    write_fake_openimage_o(str(root / "openimage_o"), n=20)
    write_standin_statistics(root / "fid.npz", np.zeros(15), np.eye(15))  # 15 stand-in features


def stage1_run(root: Path) -> List[str]:
    """In-N-Out's CIFAR-10 recipe (argmin PGD, AutoAugment and Cutout, live BatchNorm)."""
    return [str(STAGE1_CIFAR10), *SHORT, "model.model_type=WideResNet10x1",
            f"data.indist_ds_dir={root}/CIFAR10", f"run_dir={root}/s1", "lr_schedule=constant",
            "wandb_mode=offline", f"wandb_dir={root}"]


def stage2_runs(root: Path) -> List[List[str]]:
    """Two DAT runs between them taking the branches a field's read depends on."""
    digits = ["experiments/quickstart/digits.yaml", *SHORT, "attack.max_steps=2",
              "image_log.num_steps=2", "image_log.num_samples=10", f"run_dir={root}/s2a",
              "wandb_disabled=false", "wandb_mode=offline", "tags=[a]", f"wandb_dir={root}",
              "model.model_type=convnext_test", "model.use_convstem=true",
              "model.use_layernorm=false", "data.image_size=32",
              "data.outdist_dataset=OpenImageO",
              f"data.outdist_std_dir={root}/openimage_o", "openimages_max_samples=18",
              "openimages_augm=generation_od", "image_log.log_fid=true",
              f"image_log.data_dir={root}/fid.npz", "image_log.adaptive_steps=true",
              "image_log.sweep_radius=1", "image_log.sweep_num_samples=10"]
    cifar = [str(REPO / "experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml"),
             *SHORT, "attack.max_steps=2", "model.model_type=WideResNet10x1",
             f"model.ckpt_path={root}/s1/model_final.pth", "model.trust_checkpoint=true",
             "data.image_size=16", "image_log.num_steps=2", "image_log.num_samples=10",
             f"data.indist_ds_dir={root}/CIFAR10", f"data.outdist_std_dir={root}",
             f"data.tinyimages_exclusion_dir={root}/exclusion",
             f"data.outdist_exclude_index={root}/excluded.npy", "data.cutout_size=8",
             f"run_dir={root}/s2b", "wandb_disabled=true", f"image_log.data_dir={root}/fid.npz",
             "image_log.seed_images=noise", "image_log.adaptive_steps=true",
             "image_log.step_sweep_range=[1,2]", "image_log.sweep_num_samples=10",
             "image_log.blur_fid_seeds=true", "image_log.blur_kernel_size=3",
             "image_log.adaptive_blur=true",
             "eval.metrics=[precision_recall,inception_score,ood_sets,counterfactuals]",
             "eval.pr_num_real=10", "eval.pr_reference_split=test", "eval.ood_num_samples=8",
             "eval.ood_datasets=[noise]", "eval.ood_attack_steps=1",
             "eval.counterfactual_protocol=grid", "eval.counterfactual_num_images=2",
             "eval.counterfactual_num_targets=1", "eval.counterfactual_steps=1"]
    return [digits, cifar]


@pytest.fixture(scope="module")
def reads(tmp_path_factory):
    """{stage: the file keys its runs read}."""
    root = tmp_path_factory.mktemp("fields")
    write_inputs(root)
    patch = pytest.MonkeyPatch()
    patch.chdir(REPO)
    patch.delenv("WANDB_MODE", raising=False)  # the config's wandb_mode decides
    patch.setenv("WANDB_SILENT", "true")
    patch.setenv("REBM_FID_FEATURES", STANDIN_SPEC)
    recorder = ReadRecorder(section_classes())
    recorder.install()
    try:
        # stage 1 first: stage 2's second run starts from its model (model.ckpt_path)
        run_entry(recorder, 1, stage1_run(root))
        for argv in stage2_runs(root):
            run_entry(recorder, 2, argv)
    finally:
        recorder.remove()
        patch.undo()
    return recorder.keys_read()


LEAF_KEYS = [key for key, _, _, _ in file_leaves(TrainConfig())]
# the original's keys without effect, and those read only elsewhere
DECLARED_UNREAD = set(IGNORED_FIELDS) | set(KEYS_WITHOUT_EFFECT) | set(READ_ONLY_ON)


@pytest.mark.slow
def test_every_field_is_read_by_a_stage(reads):
    """A field no stage reads is a key that loads and does nothing: wire it, remove it, or
    declare it (the original's keys without effect: rebm/compat/config_fields.py)."""
    read = set().union(*reads.values())
    unread = [key for key in LEAF_KEYS if key not in read and key not in DECLARED_UNREAD]
    assert not unread, f"config keys that no training stage reads: {', '.join(unread)}"


@pytest.mark.slow
def test_declared_unread_fields_are_unread(reads):
    """A declaration stays true: a key declared without effect (the original's) or read only
    elsewhere (READ_ONLY_ON) is not read by the runs."""
    read = set().union(*reads.values())
    stale = sorted(DECLARED_UNREAD & read)
    assert not stale, f"declared unread, but read by a training run: {', '.join(stale)}"


@pytest.mark.slow
def test_stage1_reads_its_method_keys_only(reads):
    """Stage 1's warning names the method keys it does not read (DAT's): it reads keys of
    every section in STAGE1_METHOD_KEYS and none of the other method keys."""
    stored = {key: path for key, path, _, _ in file_leaves(TrainConfig())}
    method_read = {stored[key].split(".")[1] for key in reads[1]
                   if stored[key].startswith("method.")}
    assert method_read == set(STAGE1_METHOD_KEYS)
    assert STAGE1.unread == DAT_ONLY_KEYS


@pytest.mark.slow
@pytest.mark.parametrize("stage,path", SHIPPED, ids=lambda p: str(p).split("/")[-1])
def test_shipped_config_sets_only_keys_its_stage_reads(reads, stage, path):
    """Every key a shipped config sets is read by its stage (or declared)."""
    cfg = load_config(str(path))
    unread = [key for key in explicit_keys(cfg) if key in LEAF_KEYS
              and key not in reads[stage] and key not in DECLARED_UNREAD
              and (stage, key) not in SET_BUT_UNREAD_BY_STAGE]
    assert not unread, f"{path.name} sets keys stage {stage} does not read: {', '.join(unread)}"


@pytest.mark.slow
def test_set_but_unread_declarations_are_true(reads):
    """A shipped config's key declared unread by its stage is indeed not read there."""
    for (stage, key), why in SET_BUT_UNREAD_BY_STAGE.items():
        assert key not in reads[stage], f"stage {stage} reads {key}: {why}"


def test_declared_paths_are_real():
    """Each READ_ONLY_ON entry names a key of the config and a function (or class) of rebm whose
    source names the field."""
    valid = set(file_keys(TrainConfig()))
    for key, (where, why) in READ_ONLY_ON.items():
        assert key in valid, key
        module, _, qualname = where.partition(":")
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        assert key.rsplit(".", 1)[-1] in inspect.getsource(target), (key, where)
        assert why


def test_key_lists_name_fields():
    """Lists of config keys in the code name keys that exist: a field removed from its section
    leaves no name behind."""
    from rebm.config.schema import DataConfig, ModelConfig
    from rebm.eval.table.cache import (
        DATA_FIELDS_WITHOUT_EFFECT,
        MODEL_FIELDS_WITHOUT_EFFECT,
        TRAINING_STREAM_FIELDS,
    )
    from rebm.models.timm_families import CONVNEXT_OPTIONS

    def names(cls: type) -> Set[str]:
        return {f.name for f in fields(cls)}

    checks = [(STAGE1_METHOD_KEYS, MethodSection), (CONVNEXT_OPTIONS, ModelConfig),
              (MODEL_FIELDS_WITHOUT_EFFECT, ModelConfig), (DATA_FIELDS_WITHOUT_EFFECT, DataConfig),
              (TRAINING_STREAM_FIELDS, DataConfig)]
    for listed, cls in checks:
        assert set(listed) <= names(cls), (cls.__name__, set(listed) - names(cls))
    valid = set(file_keys(TrainConfig()))
    sections = {key.split(".")[0] for key in valid if "." in key}
    for key in (*RUN_KEYS, *VALUE_BEFORE_THE_KEY):
        assert key in valid or key in sections, key
    assert set(KEYS_WITHOUT_EFFECT) <= set(LEAF_KEYS), set(KEYS_WITHOUT_EFFECT) - set(LEAF_KEYS)
