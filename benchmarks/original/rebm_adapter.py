"""Every call the original-vs-rebm harness makes into rebm, in one place (so a refactor of rebm's
internals is adapted here and nowhere else). rebm's side and the CI twin of the trajectory test
use only these functions.

rebm runs as a user's training does: a real `Trainer` (method DAT) built from a config, its
weights from `model.ckpt_path`, each step its `train_step_all_ranks` (the update, EMA, the
curriculum's AUC and decision), fed the stored batches instead of its loader's.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

import torch

from benchmarks.original.common import Job


def config_overrides(job: Job, variant: str) -> List[str]:
    """rebm's config of the job's spec: the same model, attacks, optimizer, curriculum, EMA and
    loss as the original's side. `variant`: "eager" (float32, no compile, attacks in two
    passes), "default" (what a long run gets: compile and fused attacks on auto), "bf16",
    "eager_nchw" (eager with the weights in NCHW as the original's: on CPU rebm's default is
    channels_last, whose convolutions round differently; docs/design.md §7)."""
    s = job.spec
    speed = {
        "eager": ["model.compile=false", "fuse_attacks=false", "amp=none"],
        "eager_nchw": ["model.compile=false", "fuse_attacks=false", "amp=none",
                       "model.channels_last=false"],
        "default": ["model.compile=auto", "fuse_attacks=auto", "amp=none", "max_steps=100000"],
        "bf16": ["model.compile=auto", "fuse_attacks=auto", "amp=bf16", "max_steps=100000"],
    }[variant]
    # the dataset names the model's input normalisation: CIFAR-10's statistics for the
    # WideResNets, ImageNet's for ResNet-50 (the original's timm models always use ImageNet's)
    dataset, root = (("ImageNet", fake_imagenet(job)) if s["num_classes"] == 1000
                     else ("cifar10", fake_cifar(job)))
    return [
        f"data.indist_dataset={dataset}", "data.outdist_dataset=noise", "data.num_workers=0",
        f"data.num_classes={s['num_classes']}", f"data.image_size={s['image_size']}",
        f"data.indist_ds_dir={root}",
        f"model.model_type={s['model']}", "model.use_batchnorm=false",
        "model.normalize_input=true", f"model.ckpt_path={job.weights_path}",
        f"batch_size={s['batch_size']}", f"rand_seed={s['seed']}",
        f"attack.start_step={s['T_start']}", f"attack.max_steps={s['T_cap']}",
        f"attack.step_size={s['attack_step_size']}", "attack.norm=L2",
        f"indist_attack_clf.max_steps={s['K']}", f"indist_attack_clf.start_step={s['K']}",
        f"indist_attack_clf.step_size={s['clf_step_size']}",
        f"indist_attack_clf.eps={s['clf_eps']}", "indist_attack_clf.norm=L2",
        f"optimizer={s['optimizer']}", f"lr={s['lr']}", f"wd={s['wd']}", "r1reg=0.0",
        "clf_indist_weight=1.0", "clf_outdist_weight=0.0", "clf_adv_weight=1.0",
        f"AUC_th={s['auc_threshold']}", f"min_imgs_per_threshold={s['window_images']}",
        "use_ema=true", f"ema_decay={s['ema_decay']}", "logsumexp=true",
        "logsumexp_sampling=false", "samples_per_attack_step=null",
        "n_imgs_per_evaluation_log=null", "wandb_disabled=true", "wandb_mode=disabled",
        f"device={job.device}", f"run_dir={os.path.join(job.workdir, f'rebm_run_{variant}')}",
        *speed,
    ]


def fake_cifar(job: Job) -> str:
    """A tiny CIFAR-10 on disk: the Trainer builds its loader (unused: the harness feeds the
    stored batches) from a real dataset folder."""
    from rebm.standin.writers import write_fake_cifar10

    root = os.path.join(job.workdir, "fake_cifar")
    if not os.path.exists(os.path.join(root, "cifar-10-batches-py", "test_batch")):
        write_fake_cifar10(root, n_train=max(64, 4 * job.spec["batch_size"]), n_test=16)
    return root


def fake_imagenet(job: Job) -> str:
    """A tiny ImageNet on disk (1,000 classes, one small JPEG each), for the ImageNet row."""
    from rebm.standin.writers import write_fake_imagenet

    root = os.path.join(job.workdir, "fake_imagenet")
    if not os.path.exists(os.path.join(root, "meta.bin")):
        write_fake_imagenet(root, num_classes=1000, n_train=1, n_val=1, height=16, width=16)
    return root


def write_initial_weights(job: Job) -> None:
    """The spec's model with rebm's initialisation from the spec's seed: the weights both sides
    start from (the original loads them through its own checkpoint loader)."""
    from rebm.models import build_model, dataset_stats

    torch.manual_seed(job.spec["seed"])
    mean, std = dataset_stats("cifar10") if job.spec["image_size"] == 32 else (None, None)
    model = build_model(job.spec["model"], job.spec["num_classes"], mean=mean, std=std)
    torch.save(model.state_dict(), job.weights_path)


def import_training() -> None:
    """Import what a training run imports (before a memory baseline is taken)."""
    import rebm.engine.trainer  # noqa: F401
    import rebm.methods.dat  # noqa: F401


def build_trainer(job: Job, variant: str):
    """(A Trainer as `python -m rebm.training.train` builds it, in a fresh run directory, and its
    config)."""
    import shutil

    from rebm.config import load_config
    from rebm.distributed import Runtime
    from rebm.engine.trainer import Trainer
    from rebm.training.train import make_training_method

    cfg = load_config(None, config_overrides(job, variant))
    shutil.rmtree(cfg.run.run_dir, ignore_errors=True)
    return Trainer(cfg, Runtime(device=torch.device(job.device)), make_training_method), cfg


def micro_batches(batches: Dict[str, torch.Tensor], step: int, device: str) -> list:
    """Step `step`'s stored batch as rebm's one micro-batch (one process, no accumulation)."""
    from rebm.data import MicroBatch
    from rebm.data.streams import StreamBatch

    def stream(images, labels):
        n = len(images)
        index = torch.arange(n, dtype=torch.long)
        return StreamBatch(images=images, labels=labels, keys=index + step * n, indices=index)

    out_images = batches["out_images"][step]
    return [MicroBatch({
        "in": stream(batches["in_images"][step], batches["in_labels"][step]),
        "clf": stream(batches["clf_images"][step], batches["clf_labels"][step]),
        "out": stream(out_images, torch.full((len(out_images),), -1, dtype=torch.long)),
    }, step=step).to(torch.device(device))]


def train_step(trainer, micro: list, log_now: bool = True) -> Dict[str, float]:
    """One step as the loop takes it; the T it trained with, its AUCs and loss terms.
    `log_now`: a metrics-log step, which also scores the clean out-distribution batch (the
    clean AUC; one more forward, no effect on the weights). The loop logs every
    n_imgs_per_metrics_log images, so a timed step passes False."""
    T = trainer.parts.training_method.curriculum.T
    result = trainer.train_step_all_ranks(micro, log_now=log_now)
    if not (result.applied and all(math.isfinite(float(v)) for v in result.losses.values())):
        raise FloatingPointError(f"rebm's step {trainer.progress.step} is not finite")
    record = {"T": T, "adv_auc": float(result.stats["train_adv_auc"])}
    if "train_clean_auc" in result.stats:
        record["clean_auc"] = float(result.stats["train_clean_auc"])
    record.update(ebm_binary_loss=float(result.losses["ebm_binary"]),
                  clf_loss=float(result.losses["clf"]))
    return record


def final_weights(trainer) -> Dict[str, Dict[str, torch.Tensor]]:
    """The trained weights and the EMA's, under the original's state-dict names."""
    model = trainer.parts.raw_model
    model = getattr(model, "_orig_mod", model)  # a compiled model's own module
    return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "ema": {k: v.detach().cpu().clone()
                    for k, v in trainer.parts.ema.ema_model.state_dict().items()}}


def memory_plan_mib(trainer, cfg) -> Optional[float]:
    """The `--check` memory plan's total for this run, in MiB (rebm.cli.memory_plan_lines'
    numbers: rebm.models.memory.plan_memory on the model at the configured batch)."""
    from rebm.models import model_from_config
    from rebm.models.memory import plan_memory, uninitialised_copy

    plan = trainer.plan
    model = uninitialised_copy(lambda: model_from_config(cfg.model, cfg.data))
    memory = plan_memory(model, cfg.data.image_size, plan.per_device_batch_size,
                         type(trainer.parts.training_method).loss_streams(cfg.method),
                         cfg.optimization.name, cfg.ema.use_ema, 1, amp=cfg.distributed.amp,
                         eval_batch=plan.eval_batch_size)
    return memory.total / 2**20 if hasattr(memory, "total") else None


def is_compiled(trainer) -> bool:
    return trainer.parts.model is not trainer.parts.raw_model


# ---------------------------------------------------------------------------------------------
# The sample pass (benchmarks/original/samples.py): the Evaluator's shared generation pass, as
# `python -m rebm.eval.evaluate ... --samples` runs it, without FID (its Inception weights are
# not here): the sample grid (which the original's compute_fid also writes) and, with `pngs`,
# keep_samples (every sample as a PNG, as the original's compute_fid always writes them).
# ---------------------------------------------------------------------------------------------
def sample_overrides(job: Job) -> List[str]:
    """rebm's config of the sample spec: the model and weights of the job, the ImageNet row's
    generation (image_log.*), seeds from the job's seed file, the plain (non-EMA) weights."""
    s = job.spec
    # ImageNet: its normalisation statistics, which the original's timm ResNet always applies
    # (no file of the dataset is read: the pass reads only the seed file)
    return [
        "data.indist_dataset=ImageNet", "data.outdist_dataset=noise", "data.num_workers=0",
        f"data.num_classes={s['num_classes']}", f"data.image_size={s['image_size']}",
        f"data.indist_ds_dir={os.path.join(job.workdir, 'no_imagenet')}",
        f"model.model_type={s['model']}", "model.use_batchnorm=false",
        "model.normalize_input=true", f"model.ckpt_path={job.weights_path}",
        "use_ema=false", f"rand_seed={s['seed']}", f"batch_size={s['sample_batch']}",
        f"per_device_eval_batch_size={s['sample_batch']}",
        f"image_log.num_samples={s['num_samples']}", f"image_log.num_steps={s['sample_steps']}",
        f"image_log.step_size={s['sample_step_size']}", "image_log.eps=.inf",
        "image_log.norm=L2", "image_log.adaptive_steps=false", "image_log.log_fid=false",
        f"image_log.seed_images={seeds_path(job)}", "logsumexp_sampling=false",
        "keep_samples=false", "wandb_disabled=true", "wandb_mode=disabled",
        f"device={job.device}", f"run_dir={os.path.join(job.workdir, 'rebm_samples')}",
    ]


def seeds_path(job: Job) -> str:
    return os.path.join(job.workdir, "seeds.pt")


def build_sampler(job: Job):
    """(An Evaluator of the sample grid and keep_samples, started; the model with the job's
    weights, as the evaluate command loads it; the config)."""
    from rebm.config import load_config
    from rebm.distributed import Runtime
    from rebm.eval.evaluator import Evaluator, load_eval_model

    cfg = load_config(None, sample_overrides(job))
    runtime = Runtime(device=torch.device(job.device))
    evaluator = Evaluator(cfg.evaluation, runtime, ["sample_grid", "keep_samples"],
                          batch_size=job.spec["sample_batch"], run_dir=cfg.run.run_dir)
    evaluator.start_all_ranks()  # the seed file is read here, once per run
    network = load_eval_model(cfg.model, cfg.evaluation.data, False, runtime)
    return evaluator, network, cfg


def sample_metrics(pngs: bool) -> List[str]:
    return ["sample_grid", "keep_samples"] if pngs else ["sample_grid"]


def sample_pass(evaluator, network, pngs: bool) -> None:
    """One evaluation's generation pass: every sample, the grids, and with `pngs` every PNG."""
    evaluator.evaluate_all_ranks(network, metrics=sample_metrics(pngs))


def sample_files_written(evaluator) -> Dict[str, str]:
    """Where the pass writes: the grids' folder and keep_samples' PNG folder."""
    from rebm.checkpoint.run_directory import RunDirectory

    run_directory = RunDirectory(evaluator.run_dir)
    return {"grids": os.path.dirname(run_directory.sample_grid(None)),
            "pngs": run_directory.samples_folder(None)}


def generated_samples(evaluator, network) -> torch.Tensor:
    """Every sample of the pass as float images (cpu, index order), from the same generation
    pass (stream_samples_all_ranks) with a sink that keeps them: the numbers to compare."""
    from rebm.eval.metric import EvalContext
    from rebm.eval.passes import eval_mode
    from rebm.eval.sampling.samples import seed_source, stream_samples_all_ranks

    evaluation = evaluator.sections["sample_grid"]
    kept: List[torch.Tensor] = []

    class Keep:
        def update(self, chunk) -> None:
            kept.append(chunk.images.detach().float().cpu())

    ctx = EvalContext(network, evaluation, evaluator.runtime, evaluator.batch_size)
    with eval_mode(network):
        stream_samples_all_ranks(ctx, seed_source(evaluation, evaluator.resources), [Keep()],
                                 evaluation.image_log.num_samples)
    return torch.cat(kept)
