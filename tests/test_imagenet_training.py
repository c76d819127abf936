"""DAT on ImageNet end to end, through the real entry points: the shipped ImageNet configs (only
sizes overridden) on a tiny ImageNet in torchvision's on-disk layout plus an OpenImage-O-style
folder, both written here as JPEGs at 64 px, with one truncated training JPEG. Each family starts
from a public-checkpoint layout written here: the `robustness` library's file (ResNet) and
Singh et al.'s ConvNeXt-ConvStem file (ConvNeXt). One straight 2-process run per family serves
the resume check, the 1-rank evaluation check and the corrupt-JPEG checks."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rebm.eval.sampling.generation import SeedImageError, SeedImages
from rebm.models import build_model
from rebm.standin.writers import (
    imagenet_wnids,
    truncate_file,
    write_fake_imagenet,
    write_fake_openimage_o,
    write_robustness_checkpoint,
)
from tests.helpers import (
    REPO,
    assert_states_identical,
    comparable,
    copy_run,
    load_state,
    max_param_diff,
    read_metrics,
    run_train,
    state_path,
)

pytestmark = pytest.mark.timeout(600)

STEPS = 3
N_VAL = 9  # 3 classes x 3: an odd count, so the 2-rank evaluation shards unevenly
WNID = imagenet_wnids(3)[0]
CORRUPT = os.path.join("train", WNID, f"{WNID}_1.JPEG")  # a training JPEG, cut in half
# Only sizes change: tiny model, 64 px, batch 8, T and K of 1-2, a state every step, one final
# evaluation (clean + robust accuracy over the whole val split), 3 samples, no FID.
SIZES = ["data.num_classes=3", "data.image_size=64", "data.num_workers=0", "batch_size=8",
         f"max_steps={STEPS}", "attack.max_steps=2", "attack.start_step=1",
         "indist_attack_clf.max_steps=1", "indist_attack_clf.start_step=1", "robust_eval_steps=1",
         "min_imgs_per_threshold=8", "n_imgs_per_metrics_log=8", "n_imgs_per_ckpt_save=8",
         "n_imgs_per_image_log=1000000", "n_imgs_per_evaluation_log=1000000",
         "image_log.log_fid=false", "image_log.adaptive_steps=false", "image_log.num_samples=3",
         "image_log.num_steps=1", "openimages_max_samples=10", "wandb_disabled=true"]


def _resnet_checkpoint(path):
    """TinyResNetImageNet in the `robustness` library's layout (normaliser copies included)."""
    torch.manual_seed(0)
    write_robustness_checkpoint(path, build_model("TinyResNetImageNet", 3).eval())


def _convstem_checkpoint(path):
    """A ConvStem ConvNeXt as Singh et al. save it (no normaliser, under DDP: 'module.*')."""
    torch.manual_seed(0)
    model = build_model("convnext_test", 3, use_convstem=True, normalize_input=False)
    torch.save({"module." + k: v for k, v in model.state_dict().items()}, path)


FAMILIES = {  # config, model type, checkpoint writer, the layout the loader must report
    "resnet": ("dat_resnet50_224px.yaml", "TinyResNetImageNet", _resnet_checkpoint,
               "['model'] > module. > robustness (model.*)"),
    "convnext": ("imagenet-dat-ConvNeXtLarge-convst-256x256-stepsize3.yaml", "convnext_test", _convstem_checkpoint,
                 "module."),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    imagenet = write_fake_imagenet(str(root / "ImageNet"), num_classes=3, n_train=6, n_val=3,
                                   height=72, width=80)
    truncate_file(os.path.join(imagenet, CORRUPT))
    write_fake_openimage_o(str(root / "OpenImageO"), n=12, height=72, width=80)
    return root


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imagenet_run(request, data, tmp_path_factory):
    """(arguments, run dir) of an uninterrupted 2-process run of STEPS steps."""
    config, model_type, write_checkpoint, _ = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    write_checkpoint(root / "pretrained.ckpt")
    args = [str(REPO / "experiments" / "imagenet" / config), *SIZES,
            f"model.model_type={model_type}", f"model.ckpt_path={root / 'pretrained.ckpt'}",
            f"data.indist_ds_dir={data / 'ImageNet'}", f"data.outdist_std_dir={data / 'OpenImageO'}",
            # the shipped configs' seed set (image_log.ood_data_dir) is OpenImage-O's fid_eval
            f"image_log.ood_data_dir={data / 'OpenImageO'}"]
    result = run_train(args, nproc=2, run_dir=root / "ws2", timeout=300).assert_ok()
    return request.param, args, root / "ws2", result.output


def _train_records(run_dir):
    return [r for r in read_metrics(run_dir) if "test_acc" not in r]


@pytest.mark.slow
def test_two_process_dat_from_the_public_checkpoint(imagenet_run, data):
    family, _, run_dir, output = imagenet_run
    assert f"layout: {FAMILIES[family][3]})" in output, output[-3000:]
    records = read_metrics(run_dir)
    train = _train_records(run_dir)
    assert [r["step"] for r in train] == [1, 2, 3]
    assert max(r["cur_outdist_steps"] for r in train) >= 1  # the negatives were attacked
    # the truncated JPEG: the run finished, the metrics count it, each rank's log lists it once
    assert sum(r["data_replaced_images"] for r in train) >= 1
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert log.count(str(data / "ImageNet" / CORRUPT)) == 1, log[-2000:]
    final = records[-1]
    assert final["step"] == STEPS and final["n_test"] == N_VAL and "robust_test_acc" in final
    assert (run_dir / "model_final.pth").exists()


@pytest.mark.slow
def test_resume_is_bit_identical(imagenet_run, tmp_path):
    """The straight run as a preemption at step STEPS would leave it (its states up to STEPS - 1,
    metrics.jsonl already holding step STEPS's record, no model_final.pth): the same command
    drops the records after its state, continues, and ends exactly where the straight run did."""
    _, args, straight_dir, _ = imagenet_run
    run_dir = copy_run(straight_dir, tmp_path / "preempted")
    state_path(run_dir, STEPS).unlink()
    (run_dir / "model_final.pth").unlink()
    result = run_train(args, nproc=2, run_dir=run_dir, timeout=300).assert_ok()
    assert f"at step {STEPS - 1}" in result.output  # it resumed rather than restarted
    assert_states_identical(load_state(straight_dir, STEPS), load_state(run_dir, STEPS))
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(straight_dir))


@pytest.mark.slow
def test_final_evaluation_is_identical_on_one_rank(imagenet_run, tmp_path):
    """The 2-rank run's final evaluation of model_final.pth, redone by the evaluation entry
    point in one process over the whole val split: the same numbers, exactly."""
    _, args, run_dir, _ = imagenet_run
    result = run_train([*args, f"model.ckpt_path={run_dir / 'model_final.pth'}", "--no-ece"],
                       nproc=1, run_dir=tmp_path / "eval", module="rebm.eval.evaluate",
                       timeout=300).assert_ok()
    one_rank = json.loads(result.output.strip().splitlines()[-1])
    two_ranks = read_metrics(run_dir)[-1]
    assert one_rank["world_size"] == 1 and one_rank["n_test"] == N_VAL
    for key in ("test_acc", "robust_test_acc", "n_test"):
        assert one_rank[key] == two_ranks[key], key


@pytest.mark.numbers
@pytest.mark.slow
@pytest.mark.parametrize("imagenet_run", ["resnet"], indirect=True)  # one family: same data path
def test_one_rank_training_agrees_with_two_despite_the_corrupt_jpeg(imagenet_run, tmp_path):
    """The replacement of the truncated JPEG is a function of the index alone: one process
    replaces and counts exactly what two do, and training agrees up to float rounding."""
    _, args, two_rank_dir, _ = imagenet_run
    run_dir = tmp_path / "ws1"
    run_train(args, nproc=1, run_dir=run_dir, threads=1, timeout=300).assert_ok()
    one, two = _train_records(run_dir), _train_records(two_rank_dir)
    assert [r["data_replaced_images"] for r in one] == [r["data_replaced_images"] for r in two]
    for a, b in zip(one, two, strict=True):
        for key in ("train_clf_loss", "train_ebm_binary_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
        assert a["cur_outdist_steps"] == b["cur_outdist_steps"]
    assert max_param_diff(load_state(run_dir, STEPS)["model"],
                          load_state(two_rank_dir, STEPS)["model"]) < 1e-5


def test_gaussian_seeds_are_refused_at_imagenet_size():
    """A full covariance at 3 x 224 x 224 would need ~170 GiB: one line instead of an OOM."""
    with pytest.raises(SeedImageError, match="data.image_size=224") as err:
        SeedImages("gaussian", 224, 0)
    assert "image_log.seed_images" in str(err.value) and "\n" not in str(err.value)
    SeedImages("gaussian", 64, 0)  # still accepted at small sizes (fitted lazily, on first use)
