"""The original's side of the harness: a worker process that drives the original DAT code
(github:xuwangyin/DAT at fb2ffc7, a checkout given by path) on the shared batches and initial
weights, and answers the coordinator's requests (common.serve).

    python benchmarks/original/original_side.py ORIGINAL_CHECKOUT JOB_JSON

Its `rebm` is the original's (its checkout comes first on this process's path). The trajectory
runs the original's own training loop, `rebm.training.train.train`, end to end: its curriculum
(the AUC deque and the break that raises T), its EMA (`AveragedModel`), its optimizer and its
stop at `total_epochs`. The harness only replaces where data and logs come from: the loaders by
the stored batches, the periodic state save by nothing, and it records what the loop computes by
wrapping the two loss functions it calls. The timed step is that loop's body, called piece by
piece with T fixed (zero_grad, compute_ebm_metrics, compute_clf_adv_loss, backward, step, EMA).
"""

from __future__ import annotations

import math
import os
import sys

ORIGINAL = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else None
if ORIGINAL:  # before anything imports a `rebm`
    sys.path.insert(0, ORIGINAL)

import common  # noqa: E402  (benchmarks/original/common.py: this script's own folder)
import timm_shim  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402


def original_config(job: common.Job, steps: int):
    """The original's TrainConfig for the job's spec, loaded by its own loader from a YAML file
    this side writes (every field the original requires, values from the spec)."""
    from rebm.training.config_classes import load_train_config

    s = job.spec
    attack = dict(attack_type="pgd", max_steps=s["T_cap"], fixed_steps=s["T_cap"],
                  start_step=s["T_start"], step_size=s["attack_step_size"], eps=math.inf,
                  norm="L2")
    clf = dict(attack_type="pgd", max_steps=s["K"], fixed_steps=s["K"], start_step=s["K"],
               step_size=s["clf_step_size"], eps=s["clf_eps"], norm="L2")
    never = 10**15  # images: no image log, metrics log or evaluation within the run
    values = dict(
        data=dict(indist_dataset="cifar10", indist_ds_dir=job.workdir, mixed_id=False,
                  outdist_dataset="noise", outdist_std_dir=job.workdir, num_workers=0,
                  num_classes=s["num_classes"], image_size=s["image_size"]),
        attack=attack, indist_attack_clf=clf,
        model=dict(model_type=s["model"], ckpt_path=job.weights_path, normalize_input=True,
                   use_batchnorm=False),
        image_log=dict(attack_type="pgd", num_steps=1, log_fid=False, data_dir=None,
                       ood_data_dir=None, img_extension="png", num_samples=1),
        optimizer=s["optimizer"], wd=s["wd"], lr=s["lr"], r1reg=0.0,
        clf_indist_weight=1.0, clf_outdist_weight=0.0, clf_adv_weight=1.0,
        r1_indist_weight=1.0, r1_outdist_weight=0.0, r1_adv_weight=0.0,
        batch_size=s["batch_size"], min_imgs_per_threshold=s["window_images"],
        AUC_th=s["auc_threshold"], rand_seed=s["seed"],
        n_imgs_per_metrics_log=never, n_imgs_per_image_log=never,
        n_imgs_per_evaluation_log=None, wandb_project="harness",
        wandb_dir=job.workdir, wandb_disabled=True, tags=[], fixed_lr=True,
        use_ema=True, logsumexp=True, logsumexp_sampling=False, total_epochs=1,
        use_ddp=False, robust_eval=False,
    )
    path = os.path.join(job.workdir, "original_config.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(values, fh)
    cfg = load_train_config(path)
    cfg.attack.eps = math.inf  # YAML writes .inf; make sure it reads back as a float
    return cfg


class FromFile(list):
    """The stored batches as a loader: `len` is the run's step count (so total_epochs=1 stops
    the original's loop after exactly that many steps) and iterating yields (images, labels)."""


def stored_loaders(job: common.Job, steps: int):
    """A replacement for the original's create_dataloaders: the same Dataloaders container,
    filled with the stored batches of every stream, in step order, forever."""
    import rebm.training.train as original_train

    batches = torch.load(job.batches_path)
    ebm = FromFile((batches["in_images"][i], batches["in_labels"][i]) for i in range(steps))
    clf = [(batches["clf_images"][i], batches["clf_labels"][i]) for i in range(steps)]
    out = [(batches["out_images"][i], torch.zeros(len(batches["out_images"][i]), dtype=torch.long))
           for i in range(steps)]
    return original_train.Dataloaders(
        indist_loader_ebm=ebm, indist_loader_clf=clf,
        indist_iter_ebm=original_train.infinite_iter(ebm),
        indist_iter_clf=original_train.infinite_iter(clf),
        outdist_iter=original_train.infinite_iter(out), test_loader=[])


class Side:
    def __init__(self, job: common.Job):
        self.job = job
        torch.set_num_threads(job.threads)
        self.bridged = timm_shim.install()
        import wandb

        wandb.init(mode="disabled")  # what the original's entry point does with wandb_disabled
        self.settings = common.Settings(**job.settings).apply()
        self.timing = None
        self.samples = None

    def describe(self) -> dict:
        samples = {"samples": self.samples.describe()} if self.samples else {}
        return {"settings": self.settings, "bridged": self.bridged, "code": ORIGINAL, **samples}

    def trajectory(self) -> dict:
        """The original's train() over the stored batches; per-step records and final weights."""
        import rebm.training.modeling as modeling
        import rebm.training.train as original_train

        steps = self.job.spec["steps"]
        cfg = original_config(self.job, steps)
        records, captured = [], {}
        compute_ebm, compute_clf = original_train.compute_ebm_metrics, original_train.compute_clf_adv_loss
        averaged_model, get_model = original_train.AveragedModel, modeling.get_model

        def ebm_metrics(**kw):
            metrics = compute_ebm(**kw)
            records.append({"T": kw["outdist_step"], "adv_auc": float(metrics.adv_auc),
                            "clean_auc": float(metrics.clean_auc),
                            "ebm_binary_loss": float(metrics.ebm_binary_loss)})
            return metrics

        def clf_loss(**kw):
            loss = compute_clf(**kw)
            records[-1]["clf_loss"] = loss.detach().item()
            return loss

        def keep_model(*a, **kw):
            captured["model"] = get_model(*a, **kw)
            return captured["model"]

        def keep_ema(*a, **kw):
            captured["ema"] = averaged_model(*a, **kw)
            return captured["ema"]

        original_train.create_dataloaders = lambda *a, **kw: stored_loaders(self.job, steps)
        original_train.compute_ebm_metrics, original_train.compute_clf_adv_loss = ebm_metrics, clf_loss
        original_train.AveragedModel, modeling.get_model = keep_ema, keep_model
        modeling.save_training_state = lambda **kw: None  # its periodic save: no files here
        original_train.train(cfg)
        model = captured["model"].module
        path = os.path.join(self.job.workdir, "original_final.pt")
        torch.save({"model": model.state_dict(), "ema": captured["ema"].module.state_dict()}, path)
        return {"steps": records, "final_weights": path}

    def prepare_timing(self) -> dict:
        """The model, optimizer, EMA and losses as the original's train() builds them, T fixed."""
        import rebm.training.modeling as modeling
        import rebm.training.train as original_train

        cfg = original_config(self.job, self.job.spec["steps"])
        device = torch.device(self.job.device)
        baseline = common.current_rss_mib()  # its code imported, nothing built yet
        model = modeling.get_model(model_config=cfg.model, device=device,
                                   num_classes=cfg.data.num_classes,
                                   indist_dataset=cfg.data.indist_dataset)
        ema = original_train.AveragedModel(model.module, avg_type="ema", ema_decay=0.999,
                                           avg_batchnorm=True, device=device)
        optimizer = modeling.get_optimizer(model=model, optimizer_name=cfg.optimizer,
                                           lr=cfg.lr, wd=cfg.wd)
        # on the device as its loop moves them; the in-distribution labels stay on the host, as
        # its loop leaves them (train.py: `indist_labels_ebm = train_indist_batch[1]`)
        batches = {k: v if k == "in_labels" else v.to(device)
                   for k, v in torch.load(self.job.batches_path).items()}
        self.timing = (cfg, model, ema, optimizer, batches)
        return {"params": sum(p.numel() for p in model.parameters()),
                "baseline_rss_mib": baseline}

    def step(self, index: int) -> None:
        """One step of the original's loop body (train.py), the curriculum's T fixed at the cap."""
        import rebm.training.train as original_train

        cfg, model, ema, optimizer, b = self.timing
        i = index % len(b["in_labels"])
        optimizer.zero_grad()
        ebm = original_train.compute_ebm_metrics(
            indist_imgs=b["in_images"][i], indist_labels=b["in_labels"][i],
            outdist_imgs=b["out_images"][i], outdist_step=cfg.attack.max_steps, model=model,
            cfg=cfg, criterion=torch.nn.BCEWithLogitsLoss(reduction="mean"))
        clf = original_train.compute_clf_adv_loss(
            indist_imgs=b["clf_images"][i], indist_labels=b["clf_labels"][i], model=model,
            cfg=cfg, criterion=torch.nn.CrossEntropyLoss(reduction="mean"))
        (ebm.ebm_total_loss + clf).backward()
        optimizer.step()
        with torch.no_grad():
            ema.update_parameters(model.module)

    def time_steps(self, first: int, count: int) -> list:
        return common.time_calls(self.step, first, count, torch.device(self.job.device))

    def flops(self) -> float:
        return common.count_gflop(lambda: self.step(0))

    def peak_memory(self) -> dict:
        return common.peak_memory(self.job.device)

    def prepare_samples(self) -> dict:
        baseline = common.current_rss_mib()
        self.samples = SampleSide(self.job)
        return {"baseline_rss_mib": baseline, **self.samples.describe()}

    def time_samples(self, variant: str = "original") -> float:
        return self.samples.time_pass()

    def keep_samples(self) -> str:
        return self.samples.keep_samples()


# ---------------------------------------------------------------------------------------------
# The sample pass (benchmarks/original/samples.py): the original's FID evaluation path,
# evaluate_image_generation -> compute_fid, with pytorch-fid and the Inception Score stubbed.
# ---------------------------------------------------------------------------------------------
def sample_config(job: common.Job):
    """The original's TrainConfig for the sample spec: its image_log as the ImageNet FID
    template sets it (PGD, L2 steps, no radius, PNG files), seeds from the shared seed file
    (compute_fid reads a file with torch.load), the spec's batch and data.num_workers (its loader
    workers and PNG-writing threads), keep_samples on so that no clean-up runs in the timer."""
    s = job.spec
    cfg = original_config(job, s["steps"])
    log = cfg.image_log
    log.attack_type, log.num_steps, log.step_size = "pgd", s["sample_steps"], s["sample_step_size"]
    log.eps, log.norm, log.log_fid, log.adaptive_steps = math.inf, "L2", True, False
    log.num_samples, log.img_extension = s["num_samples"], "png"
    log.ood_data_dir = os.path.join(job.workdir, "seeds.pt")
    log.data_dir = os.path.join(job.workdir, "no_fid_statistics.npz")  # read by the stub only
    log.save_dir = os.path.join(job.workdir, "original_samples", "pngs")
    cfg.batch_size, cfg.data.num_workers = s["sample_batch"], s["num_workers"]
    cfg.keep_samples, cfg.logsumexp_sampling = True, False
    return cfg


class SampleSide:
    """The original's sample pass on the shared weights and seeds (`Side` holds one)."""

    def __init__(self, job: common.Job):
        import rebm.eval.eval_utils as eval_utils

        import rebm.training.modeling as modeling

        self.job, self.eval_utils = job, eval_utils
        self.stubbed = {"calculate_fid_given_paths": 0, "compute_inception_score": 0}

        def no_fid(*a, **kw):
            self.stubbed["calculate_fid_given_paths"] += 1
            return float("nan")

        def no_is(*a, **kw):
            self.stubbed["compute_inception_score"] += 1
            return float("nan"), float("nan")

        eval_utils.calculate_fid_given_paths, eval_utils.compute_inception_score = no_fid, no_is
        self.cfg = sample_config(job)
        self.model = modeling.get_model(model_config=self.cfg.model,
                                        device=torch.device(job.device),
                                        num_classes=self.cfg.data.num_classes,
                                        indist_dataset=self.cfg.data.indist_dataset)
        self.model.eval()  # as eval_fid.run_fid_evaluation leaves it

    def describe(self) -> dict:
        return {"generation_device": str(self.cfg.device), "save_dir": self.cfg.image_log.save_dir,
                "stubbed_calls": dict(self.stubbed)}

    def time_pass(self) -> float:
        import shutil
        import time

        shutil.rmtree(self.cfg.image_log.save_dir, ignore_errors=True)
        device = torch.device(self.job.device)
        common.sync(device)
        started = time.perf_counter()
        self.eval_utils.evaluate_image_generation(self.model, self.cfg)
        common.sync(device)
        return time.perf_counter() - started

    def keep_samples(self) -> str:
        """One untimed pass whose generated images (float, index order) are kept in a file."""
        generate, kept = self.eval_utils.generate_images, []

        def keep(**kw):
            images = generate(**kw)
            kept.append(images.detach().float().cpu())
            return images

        self.eval_utils.generate_images = keep
        try:
            self.time_pass()
        finally:
            self.eval_utils.generate_images = generate
        path = os.path.join(self.job.workdir, "original_samples.pt")
        torch.save(torch.cat(kept), path)
        return path


def main() -> None:
    channel = common.protocol_stdout()
    side = Side(common.Job.from_json(sys.argv[2]))
    common.serve({"describe": side.describe, "trajectory": side.trajectory,
                  "prepare_timing": side.prepare_timing, "time_steps": side.time_steps,
                  "flops": side.flops, "peak_memory": side.peak_memory,
                  "prepare_samples": side.prepare_samples, "time_samples": side.time_samples,
                  "keep_samples": side.keep_samples}, channel)


if __name__ == "__main__":
    main()
