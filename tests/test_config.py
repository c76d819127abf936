"""Typed config: loading, overrides, validation errors, --check on every experiment file."""

import math
import os
import sys

import pytest
import torch

from rebm.config import (
    ConfigError,
    TrainConfig,
    explicit_keys,
    ignored_fields_notice,
    ignored_fields_set,
    load_config,
    plan_batches,
    replace,
    to_dict,
    validate,
)
from rebm.distributed import Runtime
from rebm.training import train as train_entry
from tests.helpers import REPO, TRAINING_CONFIGS, run_command

# experiments/imagenet/*: test_imagenet_configs.py (--check builds those big models for the
# memory plan: once is enough).
EXPERIMENTS = [str(p) for p in TRAINING_CONFIGS if p.parent.name != "imagenet"]


def run_main(capsys, *argv):
    """The real entry function, in process; returns (exit code, stdout, stderr)."""
    try:
        code = train_entry.main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    # elastic's @record turns SystemExit(0) (e.g. from --help) into a None return
    return (0 if code is None else code), out.out, out.err


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.split("experiments/")[-1])
def test_every_experiment_passes_check(capsys, path):
    """Each shipped config through its own entry point: a stage-1 config (its name says so)
    through InNOutRobustnessMean0_cifar100/train_at.py, which DAT's entry would refuse (argmin
    PGD is stage 1's attack)."""
    if "stage1" in os.path.basename(path):
        from InNOutRobustnessMean0_cifar100 import train_at

        try:
            code = train_at.main([path, "--check"])
        except SystemExit as stop:
            code = stop.code
        captured = capsys.readouterr()
        code, out, err = (0 if code is None else code), captured.out, captured.err
    else:
        code, out, err = run_main(capsys, path, "--check")
    assert code == 0, err
    assert "batch_size:" in out and "Traceback" not in err


def test_original_format_keeps_fields(tmp_path):
    cfg = load_config(str(REPO / "experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml"))
    assert math.isinf(cfg.method.attack.eps) and cfg.logging.tags == ["dat", "cifar10", "wrn34x10"]
    assert cfg.data.indist_dataset == "cifar10-conditional" and cfg.schedule.batch_size == 128
    assert ignored_fields_notice(cfg) is None  # shipped configs set no field without effect
    # unused original fields are accepted and reported
    original = tmp_path / "original.yaml"
    original.write_text("tinyimages_loader: innout\nattack:\n  fixed_steps: 10\n"
                        "image_log:\n  img_extension: png\n  attack_type: pgd\n")
    cfg = load_config(str(original))
    assert ignored_fields_set(cfg) == ["attack.fixed_steps", "image_log.attack_type",
                                       "image_log.img_extension", "tinyimages_loader"]


def test_overrides_nested_and_top_level():
    cfg = load_config(str(REPO / "experiments/quickstart/digits.yaml"),
                      ["lr=0.1", "attack.max_steps=3", "tags=[a,b]", "data.num_workers=1"])
    assert (cfg.optimization.lr, cfg.method.attack.max_steps, cfg.logging.tags, cfg.data.num_workers) == (0.1, 3, ["a", "b"], 1)


@pytest.mark.slow
def test_check_via_subprocess_prints_yaml():
    result = run_command([sys.executable, "-m", "rebm.training.train",
                          "experiments/quickstart/digits.yaml", "--check"], timeout=120)
    assert result.returncode == 0, result.output
    assert "model_type: WideResNet10x1" in result.output


@pytest.mark.parametrize("argv", [["--help"], ["experiments/quickstart/digits.yaml", "--check"],
                                  ["experiments/quickstart/digits.yaml", "lr=-1"]])
def test_the_collector_is_on_again_after_the_start(capsys, argv):
    """The start runs with the garbage collector paused (rebm.cli.collector_paused); whichever
    way it ends, the collector is running afterwards."""
    import gc

    run_main(capsys, *argv)
    assert gc.isenabled()


def test_help(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0 and "--check" in out and "key=value" in out


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optimiser=sgd", "unknown config key 'optimiser'. Did you mean 'optimizer'?"),
        ("attack.max_step=3", "Did you mean 'attack.max_steps'?"),
        ("lr=fast", "wrong type for 'lr'"),
        ("batch_size=1.5", "wrong type for 'batch_size'"),
        ("model.model_type=ResNet9000", "'model.model_type: ResNet9000' is not a valid choice"),
        ("data.indist_dataset=mnist", "'data.indist_dataset: mnist' is not a valid choice"),
        ("optimizer=lion", "'optimizer: lion' is not a valid choice; use one of sgd, adam, adamw"),
        ("attack.step_size=-1", "'attack.step_size' must be >= 0"),
        ("per_device_batch_size=48", "not divisible by per_device_batch_size 48"),
        ("lr", "override 'lr' must look like key=value"),
        ("indist_attack_clf.attack_type=argmin_pgd",
         "'indist_attack_clf.attack_type' is 'argmin_pgd'; DAT's classifier attack is 'pgd'"),
        # a section given a value names the section (OmegaConf's own error names no key)
        ("attack=5", "'attack' is a section, not a value (got 5); set one of its keys instead"),
        # a key by the section rebm stores it in: the file's key is named
        ("schedule.batch_size=64", "unknown config key 'schedule.batch_size'. Did you mean "
                                   "'batch_size'?"),
        ("method.attack.eps=3", "unknown config key 'method.attack.eps'. Did you mean 'attack.eps'?"),
        ("data.augm_type_generation=none", "Did you mean 'augm_type_generation'?"),
        ("eval.robust_eval=false", "Did you mean 'robust_eval'?"),
        ("data.indist_dataset=digits model=abc", "'model' is a section, not a value"),
        # one rule for case: every named choice is matched exactly, as the original matches them
        ("optimizer=Adam", "'optimizer: Adam' is not a valid choice; use one of sgd, adam, adamw; "
                           "names are case-sensitive: use 'adam'"),
        ("attack.norm=l2", "'attack.norm: l2' is not a valid choice; use one of L2, Linf; names "
                           "are case-sensitive: use 'L2'"),
        ("lr_schedule=Cosine", "'lr_schedule: Cosine' is not a valid choice; use one of cosine, "
                               "constant; names are case-sensitive: use 'cosine'"),
        ("data.indist_dataset=Digits", "names are case-sensitive: use 'digits'"),
        ("amp=BF16", "'amp: BF16' is not a valid choice"),
    ],
)
def test_bad_config_is_one_clear_line(capsys, override, expected):
    code, out, err = run_main(capsys, "experiments/quickstart/digits.yaml", *override.split(),
                              "--check")
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err


def test_bad_key_in_file_names_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  indist_dataset: digits\n  num_clases: 10\n")
    code, _, err = run_main(capsys, str(bad), "--check")
    assert code == 2 and str(bad) in err and "data.num_classes" in err


def test_a_section_given_a_value_in_a_file_names_the_file_and_the_section(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  indist_dataset: digits\nattack: 5\n")
    code, _, err = run_main(capsys, str(bad), "--check")
    assert code == 2 and f"{bad}: 'attack' is a section, not a value (got 5)" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_missing_config_file(capsys):
    code, _, err = run_main(capsys, "no/such.yaml", "--check")
    assert code == 2 and "no/such.yaml" in err


def test_check_warns_about_missing_paths_but_passes(capsys):
    code, out, err = run_main(capsys, "experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml", "--check",
                              "data.indist_ds_dir=/nonexistent/cifar", "ddp_backend=nccl")
    assert code == 0
    assert ("warning: data.indist_ds_dir: /nonexistent/cifar/cifar-10-batches-py/ does not exist; "
            "set data.download=true to download it") in err, err
    assert "ddp_backend: nccl needs CUDA" in err


@pytest.mark.parametrize("batch, world, per_device, expect", [
    (128, 1, None, (128, 1)), (128, 2, None, (64, 1)), (128, 2, 16, (16, 4)),
    (128, 4, 32, (32, 1)), (96, 3, None, (32, 1)),
])
def test_batch_plan(batch, world, per_device, expect):
    cfg = load_config(None, [f"batch_size={batch}", f"per_device_batch_size={per_device}"
                             if per_device else "batch_size=%d" % batch])
    plan = plan_batches(cfg.schedule, cfg.eval, world)
    assert (plan.per_device_batch_size, plan.accumulation_steps) == expect
    assert plan.per_device_batch_size * plan.accumulation_steps * world == batch


def test_batch_not_divisible_by_world_size():
    cfg = load_config(None, ["batch_size=64"])
    with pytest.raises(ConfigError, match="not divisible by the world size 3"):
        plan_batches(cfg.schedule, cfg.eval, 3)


def test_configs_doc_is_generated_from_the_dataclasses():
    from rebm.config.docs import render

    committed = (REPO / "docs" / "configs.md").read_text()
    assert committed == render(), "regenerate: python -m rebm.config.docs > docs/configs.md"
    for key in ("batch_size", "per_device_batch_size", "attack.eps", "data.indist_dataset"):
        assert f"`{key}`" in committed


def test_a_bad_override_is_blamed_on_the_command_line():
    with pytest.raises(ConfigError, match=r"^command line: 'amp: fp8' is not a valid choice"):
        load_config(str(REPO / "experiments/quickstart/digits.yaml"), ["amp=fp8"])


def test_original_spellings_are_renamed_before_merging(tmp_path):
    cfg = load_config(None, ["fp16=true", "resume_path=runs/x/checkpoints"])
    assert cfg.distributed.amp == "fp16" and cfg.run.resume_from_state == "runs/x/checkpoints"
    assert "fp16" not in to_dict(cfg) and "resume_path" not in to_dict(cfg)
    assert {"amp", "resume_from_state"} <= set(explicit_keys(cfg))
    assert load_config(None, ["fp16=false"]).distributed.amp == "none"
    # a later source wins as for any key; both spellings in one source must agree
    assert load_config(None, ["fp16=true", "amp=fp16"]).distributed.amp == "fp16"
    config = tmp_path / "both.yaml"
    config.write_text("fp16: true\namp: bf16\n")
    with pytest.raises(ConfigError, match=r"both.yaml: 'fp16: True' and 'amp: bf16' disagree"):
        load_config(str(config), ["amp=fp16"])  # the file itself is contradictory


def test_validation_only_checks():
    cfg = TrainConfig()
    cfg.data.indist_dataset, cfg.model.model_type = "digits", "WideResNet10x1"
    before = to_dict(cfg)
    validate(cfg)
    assert to_dict(cfg) == before


def _typed(value):
    """A value with the type of every node spelled out (a tuple and a list compare unequal)."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_typed(v) for v in value])
    return type(value).__name__, value


@pytest.mark.parametrize("path", [str(p) for p in TRAINING_CONFIGS],
                         ids=lambda p: p.split("experiments/")[-1])
def test_to_dict_is_omegaconfs_container_type_for_type(path):
    """to_dict (what states and wandb store) is a fast stand-in for OmegaConf's conversion."""
    from omegaconf import OmegaConf

    from rebm.config.layout import to_file_layout

    cfg = load_config(path, ["eval.ood_datasets=[noise,svhn]", "eval.ood_roots.svhn=/x",
                             "image_log.step_sweep_range=[1,2]"])
    container = OmegaConf.to_container(OmegaConf.structured(cfg))
    assert _typed(to_dict(cfg)) == _typed(to_file_layout(container))


def test_explicit_keys_survive_a_replaced_copy():
    cfg = load_config(str(REPO / "experiments/quickstart/digits.yaml"), ["lr=0.5"])
    moved = replace(cfg, run_dir="elsewhere")
    assert moved.run.run_dir == "elsewhere" and explicit_keys(moved) == explicit_keys(cfg)
    assert "lr" in explicit_keys(cfg) and explicit_keys(TrainConfig()) == ()
    with pytest.raises(AttributeError, match="frozen"):
        moved.optimization.lr = 1.0
    with pytest.raises(AttributeError, match="no config key 'lr'"):
        moved.lr = 1.0


def test_legacy_fields_are_one_notice_line():
    cfg = load_config(None, ["mixup_alpha=3", "attack.fixed_steps=3"])
    notice = ignored_fields_notice(cfg)
    assert "\n" not in notice and notice.endswith("attack.fixed_steps, mixup_alpha")
    assert ignored_fields_notice(load_config(None, [])) is None


@pytest.mark.parametrize("override, expected", [
    ("image_log.attack_type=adam", "'image_log.attack_type: adam' is not supported (in the "
                                   "original DAT code: adam generates the samples by Adam"),
    ("indist_perturb=true", "'indist_perturb: True' is not supported"),
    ("tinyimages_loader=GOOD", "remove the key or set it to 'innout'"),
    ("image_log.img_extension=jpg", "remove the key or set it to null or 'png'"),
    ("image_log.target_class=3", "'image_log.target_class: 3' is not supported"),
    ("outdist_dataset_ood_detection=svhn", "rebm's evaluate --ood scores data.outdist_dataset"),
])
def test_fields_with_an_effect_rebm_lacks_are_refused(capsys, override, expected):
    code, _, err = run_main(capsys, str(REPO / "experiments/quickstart/digits.yaml"), override,
                            "--check")
    assert code == 2 and expected in err
    assert len(err.strip().splitlines()) == 1, err


def _samples_from(overrides, tmp_path):
    """Samples of a seeded model through the real generation code (one process)."""
    from rebm.models import model_from_config
    from tests.standins import generate_samples

    cfg = load_config(str(REPO / "experiments/quickstart/digits.yaml"),
                      ["image_log.num_steps=2", *overrides])
    torch.manual_seed(0)
    model = model_from_config(cfg.model, cfg.data).eval()
    images, labels = generate_samples(model, cfg, Runtime(), num_samples=12)
    return cfg, images, labels


@pytest.mark.numbers
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_ood_data_dir_is_the_original_seed_set(tmp_path, kind):
    """image_log.ood_data_dir=X and image_log.seed_images=X: the same samples, from X's images
    resized to data.image_size (24 px here, 16 in the config)."""
    from PIL import Image

    seeds = torch.randint(0, 256, (5, 3, 24, 24), generator=torch.Generator().manual_seed(1),
                          dtype=torch.uint8)
    if kind == "file":
        source = tmp_path / "seeds.pt"
        torch.save(seeds, source)
    else:
        source = tmp_path / "seeds" / "class0"
        source.mkdir(parents=True)
        for i, image in enumerate(seeds):
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(source / f"{i:03d}.png")
        source = source.parent
    cfg, original, labels = _samples_from([f"image_log.ood_data_dir={source}"], tmp_path)
    assert cfg.image_log.seed_images == str(source)
    _, ours, labels_ours = _samples_from([f"image_log.seed_images={source}"], tmp_path)
    _, noise, _ = _samples_from([], tmp_path)
    assert original.shape == (12, 3, 16, 16) and torch.equal(labels, labels_ours)
    assert torch.equal(original, ours) and not torch.equal(original, noise)


def test_ood_data_dir_and_seed_images_may_not_disagree(capsys, tmp_path):
    config = tmp_path / "both.yaml"
    config.write_text("image_log:\n  seed_images: noise\n  ood_data_dir: seeds.pt\n")
    code, _, err = run_main(capsys, str(config), "--check")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'image_log.ood_data_dir: seeds.pt' and 'image_log.seed_images: noise' disagree" in err


def test_a_state_from_before_the_exclusion_lists_compares_as_excluding_none():
    """`data.tinyimages_exclusion_dir` came with a default that excludes records; a run saved
    before the key existed excluded none, so it continues only with the key set to null
    (rebm/config/identity.py, VALUE_BEFORE_THE_KEY), never silently on other data."""
    from rebm.config.identity import training_diff

    current = load_config("experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml", [])
    saved = to_dict(current)
    del saved["data"]["tinyimages_exclusion_dir"]
    assert training_diff(saved, to_dict(current)) == [
        "data.tinyimages_exclusion_dir: unset (trained as None) -> './data/TinyImagesExclusionIdcs'"]
    without = load_config("experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml",
                          ["data.tinyimages_exclusion_dir=null"])
    assert training_diff(saved, to_dict(without)) == []
    # a run on another out-distribution never read the lists: the key compares as its default
    digits = load_config("experiments/quickstart/digits.yaml", [])
    saved = to_dict(digits)
    del saved["data"]["tinyimages_exclusion_dir"]
    assert training_diff(saved, to_dict(digits)) == []
