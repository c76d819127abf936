"""Config sections and registries (docs/design.md §2): datasets and optimizers are registries
that validation checks, a new one is one module; stage 1's learning-rate schedule is a config key
(`lr_schedule`, `--schedule` its alias) that a resume may not change; `fixed_lr` is stage 2's
rule; the compatibility code lives in rebm/compat."""

import importlib
import sys

import pytest
import torch

from rebm.config import ConfigError, load_config, to_dict, training_diff
from rebm.config.datasets import INDIST_DATASETS, OUTDIST_DATASETS, dataset_reads_files
from rebm.config.optimizers import OPTIMIZERS
from rebm.data import indist_source, outdist_source
from rebm.engine.optimizers import build_optimizer
from rebm.methods.stages import STAGE1 as STAGE_1
from rebm.methods.stages import STAGE2 as STAGE_2
from rebm.registry import Registry
from tests.helpers import CONFIG, REPO, run_command

STAGE1 = "experiments/quickstart/digits_stage1.yaml"
TRAIN_AT = str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py")


def test_the_dataset_registries_hold_the_datasets_and_their_defaults():
    assert INDIST_DATASETS.names() == ("cifar10", "cifar10-conditional", "cifar100",
                                       "cifar100-conditional", "digits", "imagefolder",
                                       "ImageNet")
    assert set(OUTDIST_DATASETS.names()) == {"tinyimages", "80m-tinyimages", "imagefolder",
                                             "OpenImageO", "tensorfile", "noise",
                                             "uniform-noise", "lowfreq-noise"}
    # an unset data.num_classes / data.image_size is the dataset's (its registry entry)
    for name, classes, size in (("cifar100", 100, 32), ("ImageNet", 1000, 256),
                                ("digits", 10, 32), ("imagefolder", 10, 32)):
        cfg = load_config(None, [f"data.indist_dataset={name}", "model.model_type=WideResNet10x1"])
        assert (cfg.data.num_classes, cfg.data.image_size) == (classes, size), name
    cfg = load_config(None, ["data.indist_dataset=ImageNet", "data.image_size=64",
                             "data.num_classes=10", "model.model_type=WideResNet10x1"])
    assert (cfg.data.num_classes, cfg.data.image_size) == (10, 64)


def test_the_registries_load_real_data():
    cfg = load_config(CONFIG, ["data.outdist_dataset=lowfreq-noise"])
    train = indist_source(cfg.data, "train")
    assert len(train) == 1438 and train.name == "digits train"
    noise = outdist_source(cfg.inputs, length=7)
    assert len(noise) == 7 and noise.name == "lowfreq-noise"


@pytest.mark.parametrize("override, expected", [
    ("data.indist_dataset=cifar1O", "'data.indist_dataset: cifar1O' is not a valid choice; use "
     "one of cifar10, cifar10-conditional, cifar100, cifar100-conditional, digits, imagefolder, "
     "ImageNet; did you mean 'cifar10'?"),
    ("data.outdist_dataset=tinyimage", "did you mean 'tinyimages'?"),
    ("optimizer=adamm", "'optimizer: adamm' is not a valid choice; use one of sgd, adam, adamw; "
     "did you mean 'adam'?"),
    ("model.model_type=WideResNet28x1O", "'model.model_type: WideResNet28x1O' is not a valid "
     "choice; use one of "),
    ("model.model_type=WideResNet28x1O", "; did you mean 'WideResNet28x10'?"),
])
def test_an_unknown_choice_names_the_key_and_the_closest_name(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [override])
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_models_datasets_optimizers_and_metrics_share_one_registry_class():
    """One mechanism (rebm/registry.py, the bottom layer): lazy loading of a package's modules
    for the models, datasets and optimizers, an explicit list for the metrics (their order is the
    order they run and are reported in), a record per entry, one-line errors for a typo."""
    from rebm.eval.metric import EvalError
    from rebm.eval.registry import METRICS, metric_classes
    from rebm.models.registry import MODELS

    registries = (MODELS, INDIST_DATASETS, OUTDIST_DATASETS, OPTIMIZERS, METRICS)
    assert all(isinstance(r, Registry) for r in registries)
    assert [r.package for r in registries[:4]] == ["rebm.models", "rebm.data.sets",
                                                   "rebm.data.sets", "rebm.engine.optimizers"]
    assert METRICS.package is None and METRICS.names()[:2] == ("accuracy", "robust_accuracy")
    assert MODELS.get("convnext_tiny").options == ("use_convstem", "use_layernorm")
    assert [m.name for m in metric_classes(["fid", "accuracy"])] == ["accuracy", "fid"]
    with pytest.raises(EvalError, match=r"^unknown metric 'fdi'; the metrics are accuracy, .* "
                                        r"Did you mean 'fid'\?$"):
        metric_classes(["accuracy", "fdi"])


def test_check_asks_the_registry_whether_a_dataset_reads_files():
    reading = {n for n in INDIST_DATASETS.names() if dataset_reads_files("indist", n)}
    assert reading == set(INDIST_DATASETS.names()) - {"digits"}
    generated = {n for n in OUTDIST_DATASETS.names() if not dataset_reads_files("outdist", n)}
    assert generated == {"noise", "uniform-noise", "lowfreq-noise"}
    assert not dataset_reads_files("indist", "no-such-set")


def test_a_new_choice_is_one_module(tmp_path, monkeypatch):
    """A registry imports every public module of its package on the first lookup: a module
    dropped into the package is a valid choice, with no list to edit."""
    package = tmp_path / "extra_optimizers"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from rebm.registry import Registry\nREGISTRY = Registry('optimizer', __name__)\n")
    (package / "plain_sgd.py").write_text(
        "import torch\nfrom extra_optimizers import REGISTRY\n\n"
        "@REGISTRY.register('plain_sgd')\n"
        "def plain_sgd(params, section):\n"
        "    return torch.optim.SGD(params, lr=section.lr)\n")
    (package / "_private.py").write_text("raise AssertionError('private modules are skipped')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry: Registry = importlib.import_module("extra_optimizers").REGISTRY
    try:
        assert registry.names() == ("plain_sgd",)
        params = [torch.nn.Parameter(torch.zeros(2))]
        section = load_config(CONFIG, ["lr=0.5"]).optimization
        assert registry.get("plain_sgd")(params, section).param_groups[0]["lr"] == 0.5
        with pytest.raises(ConfigError, match="did you mean 'plain_sgd'"):
            registry.check("plain-sgd")
    finally:
        for name in [m for m in sys.modules if m.startswith("extra_optimizers")]:
            del sys.modules[name]


def test_the_optimizers_are_the_originals():
    params = [torch.nn.Parameter(torch.zeros(3))]
    expected = {"sgd": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
                "adam": (torch.optim.Adam, {"betas": (0.0, 0.99)}),
                "adamw": (torch.optim.AdamW, {"betas": (0.9, 0.95)})}
    assert set(OPTIMIZERS.names()) == set(expected)
    for name, (cls, settings) in expected.items():
        # names are matched exactly, case included, as the original's get_optimizer matches them
        with pytest.raises(ConfigError, match=f"names are case-sensitive: use '{name}'"):
            load_config(CONFIG, [f"optimizer={name.upper()}"])
        cfg = load_config(CONFIG, [f"optimizer={name}", "lr=0.02", "wd=0.001"])
        optimizer = build_optimizer(cfg.optimization, params)
        group = optimizer.param_groups[0]
        assert type(optimizer) is cls and group["lr"] == 0.02 and group["weight_decay"] == 0.001
        assert all(group[k] == v for k, v in settings.items()), name


def test_the_schedule_is_a_config_key_with_a_default_per_stage():
    stage1, stage2 = load_config(STAGE1), load_config(CONFIG)
    assert stage1.schedule.lr_schedule is None and STAGE_1.lr_schedule(stage1.schedule) == "cosine"
    assert STAGE_2.lr_schedule(stage2.schedule) == "constant"
    constant = load_config(STAGE1, ["lr_schedule=constant"])
    assert STAGE_1.lr_schedule(constant.schedule) == "constant"
    with pytest.raises(ConfigError, match="'lr_schedule: linear' is not a valid choice"):
        load_config(STAGE1, ["lr_schedule=linear"])
    # a resume that changes the schedule is refused like any other training key
    saved = to_dict(load_config(STAGE1, ["lr_schedule=constant"]))
    assert training_diff(saved, to_dict(stage1)) == ["lr_schedule: 'constant' -> None"]


def test_fixed_lr_is_a_stage_2_rule():
    unfixed = load_config(CONFIG, ["fixed_lr=false"])  # loads: the stage is not known yet
    with pytest.raises(ConfigError, match="'fixed_lr: false' is not supported in stage 2"):
        STAGE_2.check(unfixed.schedule, unfixed.model)
    stage1 = load_config(STAGE1, ["fixed_lr=false"])
    STAGE_1.check(stage1.schedule, stage1.model)  # stage 1 does not read it
    cosine = load_config(CONFIG, ["lr_schedule=cosine"])
    with pytest.raises(ConfigError, match="'lr_schedule: cosine' is not offered in stage 2"):
        STAGE_2.check(cosine.schedule, cosine.model)


@pytest.mark.parametrize("args, expected", [
    (["--schedule", "constant"], "lr_schedule: constant"),
    (["lr_schedule=constant"], "lr_schedule: constant"),
    ([], "lr_schedule: null"),
    (["--schedule", "constant", "lr_schedule=cosine"],
     "error: command line: '--schedule constant' and 'lr_schedule=cosine' disagree"),
])
def test_the_schedule_flag_is_an_alias_of_the_key(args, expected):
    result = run_command([sys.executable, TRAIN_AT, STAGE1, *args, "--check", "--all"],
                         timeout=60)
    assert expected in result.output, result.output


def test_stage1_names_the_stage2_keys_it_does_not_read_in_one_line():
    result = run_command([sys.executable, TRAIN_AT, STAGE1, "r1reg=0.1", "clf_adv_weight=1",
                          "attack.max_steps=3", "indist_attack_clf.max_steps=2", "--check"],
                         timeout=60)
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert result.returncode == 0 and warnings == [
        "warning: stage 1 does not read attack.max_steps, clf_adv_weight, r1reg (stage-2 keys, "
        "DAT's); they have no effect here: remove them from the stage-1 config"], result.output
    clean = run_command([sys.executable, TRAIN_AT, STAGE1, "--check"], timeout=60)
    assert clean.returncode == 0 and "warning:" not in clean.output, clean.output


def test_the_stage2_keys_are_the_method_keys_stage1_does_not_read():
    assert "indist_attack_clf" not in STAGE_1.unread and "batch_size" not in STAGE_1.unread
    assert {"attack", "r1reg", "clf_adv_weight", "AUC_th", "logsumexp"} <= set(STAGE_1.unread)
    assert STAGE_2.unread == ()


def test_stage2_refuses_fixed_lr_false_in_one_line():
    result = run_command([sys.executable, "-m", "rebm.training.train", CONFIG, "fixed_lr=false",
                          "--check"], timeout=60)
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1 and "stage 2" in lines[0], result.output
