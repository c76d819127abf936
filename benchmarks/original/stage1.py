"""The stage-1 twin: rebm's adversarial training against In-N-Out's own training step (the
original's InNOutRobustness/, its AdversarialTraining train type with its argmin PGD) on the same
batches from the same weights, step by step (the loss) and at the end (weights, EMA weights).

    python -m benchmarks.original.stage1 --original PATH [--write-reference FILE]

PATH is a checkout of the original DAT code (or `git archive` of its mirror); In-N-Out runs from
PATH/InNOutRobustness in its own process, built by its own functions from its argparse defaults
(utils/run_file_helpers.py: parser, `create_optim_scheduler_swa_configs`, `create_attack_config`,
`create_trainer`) with the spec's values on its command line, and trained by its
`_inner_train` over the stored batches. Two of its imports are only needed by train types this
twin does not run (pytorch_msssim, tensorboard) and are stood in for when absent. rebm runs as
`train_at.py` does: a Trainer of stage 1's method, each step its `train_step_all_ranks`.

The run writes the original's run, rebm's spreads (1 against 2 threads; native against the
lowest kernels), the tolerances (10x the larger spread, floor 1e-6; per step for the loss) and
rebm with plain PGD (`indist_attack_clf.attack_type=pgd`), which must fall
outside them. tests/test_stage1_twin.py compares rebm with the stored file.

This module imports torch only at the top: the original's process loads it by path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

import torch

# WideResNet-10-1 at 32 px (the original's WideResNet pools 8x8), batch 8, K = 3 attack steps
# of In-N-Out's CIFAR L2 step 0.1 in its eps 0.5 ball, SGD lr 0.01 on a cosine over 100 steps
# of which the 50 run (In-N-Out: `--epochs 2`, its epoch the 50 batches; with one epoch its
# cosine scheduler would not move the rate), EMA 0.999: every piece of stage 1 acts and CI runs
# it in seconds.
SPEC = dict(model="WideResNet10x1", depth=10, widen=1, num_classes=10, image_size=32,
            batch_size=8, steps=50, K=3, step_size=0.1, eps=0.5, lr=0.01, wd=5e-4,
            ema_decay=0.999, seed=0)
HEAD = ("fc.weight", "fc.bias")
FLOOR = 1e-6
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def make_inputs(spec: dict) -> Dict[str, torch.Tensor]:
    """The batches (a per-class smooth pattern plus noise, rounded to 1/255) from the seed."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    S, B, C, H = spec["steps"], spec["batch_size"], spec["num_classes"], spec["image_size"]
    patterns = torch.nn.functional.interpolate(torch.rand(C, 3, 4, 4, generator=g), size=(H, H),
                                               mode="bilinear", align_corners=False)
    labels = torch.randint(0, C, (S, B), generator=g)
    images = (0.7 * patterns[labels] + 0.3 * torch.rand(S, B, 3, H, H, generator=g))
    return {"images": images.mul(255).round().div(255), "labels": labels}


# ---------------------------------------------------------------------------------------------
# The original's side (its own process, cwd = PATH/InNOutRobustness)
# ---------------------------------------------------------------------------------------------
def _stand_in_missing(names: List[str]) -> None:
    import importlib
    import types

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            module = types.ModuleType(name)
            module.SSIM = module.MS_SSIM = module.SummaryWriter = object
            sys.modules[name] = module


class _QuietBackend:
    """In-N-Out's OutputBackend writes TensorBoard logs; the twin reads the step's loss itself."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class _Batches:
    def __init__(self, inputs: Dict[str, torch.Tensor]):
        self.inputs, self.batch_size = inputs, inputs["images"].shape[1]

    def __len__(self) -> int:
        return len(self.inputs["images"])

    def __iter__(self):
        return iter(zip(self.inputs["images"], self.inputs["labels"], strict=True))


def run_original(workdir: str, spec: dict) -> dict:
    _stand_in_missing(["pytorch_msssim", "torch.utils.tensorboard"])
    sys.path.insert(0, os.getcwd())
    import utils.run_file_helpers as rh
    from utils.model_normalization import Cifar10Wrapper
    from utils.models.models_32x32.wide_resnet import WideResNet

    parser = argparse.ArgumentParser()
    rh.parser_add_commons(parser)
    rh.parser_add_adversarial_commons(parser)
    rh.parser_add_adversarial_norms(parser, "cifar10")
    hps = parser.parse_args([
        "--train_type", "adversarial", "--id_steps", str(spec["K"]), "--epochs", "2",
        "--schedule", "cosine", "--ema", "True", "--ema_decay", str(spec["ema_decay"]),
        "--lr", str(spec["lr"]), "--decay", str(spec["wd"]), "--bs", str(spec["batch_size"]),
        "--eps", str(spec["eps"]), "--stepsize", str(spec["step_size"])])
    model = WideResNet(spec["depth"], spec["num_classes"], spec["widen"])
    model.load_state_dict(torch.load(os.path.join(workdir, "initial_weights.pt")))
    model = Cifar10Wrapper(model)
    scheduler_config, optimizer_config = rh.create_optim_scheduler_swa_configs(hps)
    id_attack_config, _ = rh.create_attack_config(hps, "cifar10")
    trainer = rh.create_trainer(hps, model, optimizer_config, scheduler_config,
                                torch.device("cpu"), spec["num_classes"], workdir, workdir,
                                id_attack_config=id_attack_config)
    # what its train() does before the epochs, without the files it writes
    trainer._create_optimizer_scheduler()
    trainer.output_backend = _QuietBackend()
    trainer._create_parallel_model(device_ids=None)
    trainer._create_avg_model()
    trainer._create_parallel_avg_model(device_ids=None)
    losses: List[float] = []
    loss_step = trainer._loss_step

    def recording_loss_step(closure):
        def closure_recorded(log=False):
            loss = closure(log)
            losses.append(float(loss.detach()))
            return loss
        loss_step(closure_recorded)

    trainer._loss_step = recording_loss_step
    trainer._inner_train({"train_loader": _Batches(torch.load(
        os.path.join(workdir, "batches.pt")))}, 0)
    return {"steps": losses, "attack": id_attack_config,
            "final": {"model": trainer.get_model_state_dict(),
                      "ema": trainer.get_avg_model_state_dict()}}


# ---------------------------------------------------------------------------------------------
# rebm's side
# ---------------------------------------------------------------------------------------------
def rebm_overrides(workdir: str, spec: dict, attack_type: str) -> List[str]:
    return [
        "data.indist_dataset=cifar10", f"data.indist_ds_dir={os.path.join(workdir, 'cifar')}",
        "data.num_workers=0", f"data.num_classes={spec['num_classes']}",
        f"data.image_size={spec['image_size']}", f"model.model_type={spec['model']}",
        "model.use_batchnorm=true", "model.normalize_input=true", "model.compile=false",
        "model.channels_last=false", "amp=none",
        f"model.ckpt_path={os.path.join(workdir, 'initial_weights.pt')}",
        f"indist_attack_clf.attack_type={attack_type}",
        f"indist_attack_clf.max_steps={spec['K']}",
        f"indist_attack_clf.step_size={spec['step_size']}",
        f"indist_attack_clf.eps={spec['eps']}", "indist_attack_clf.norm=L2",
        "optimizer=sgd", f"lr={spec['lr']}", f"wd={spec['wd']}", "lr_schedule=cosine",
        f"batch_size={spec['batch_size']}", f"max_steps={2 * spec['steps']}",
        f"rand_seed={spec['seed']}", "use_ema=true", f"ema_decay={spec['ema_decay']}",
        "augm_type_classification=none", "augm_type_generation=none",
        "n_imgs_per_evaluation_log=null", "wandb_disabled=true", "wandb_mode=disabled",
        "device=cpu", f"run_dir={os.path.join(workdir, 'rebm_run_' + attack_type)}",
    ]


def write_inputs(workdir: str, spec: dict) -> None:
    """The batches and the initial weights (rebm's initialisation from the seed), and a tiny
    CIFAR-10 on disk for the Trainer's loader (unused: the batches are fed)."""
    from rebm.models import build_model, dataset_stats
    from rebm.standin.writers import write_fake_cifar10

    os.makedirs(workdir, exist_ok=True)
    torch.save(make_inputs(spec), os.path.join(workdir, "batches.pt"))
    torch.manual_seed(spec["seed"])
    mean, std = dataset_stats("cifar10")
    model = build_model(spec["model"], spec["num_classes"], mean=mean, std=std)
    torch.save(model.state_dict(), os.path.join(workdir, "initial_weights.pt"))
    write_fake_cifar10(os.path.join(workdir, "cifar"), n_train=64, n_test=16)


def run_rebm(workdir: str, spec: dict, attack_type: str = "argmin_pgd") -> dict:
    import shutil

    from InNOutRobustnessMean0_cifar100.train_at import make_training_method
    from rebm.config import load_config
    from rebm.data import MicroBatch
    from rebm.data.streams import StreamBatch
    from rebm.distributed import Runtime
    from rebm.engine.trainer import Trainer

    cfg = load_config(None, rebm_overrides(workdir, spec, attack_type))
    shutil.rmtree(cfg.run.run_dir, ignore_errors=True)
    trainer = Trainer(cfg, Runtime(device=torch.device("cpu")), make_training_method)
    inputs = torch.load(os.path.join(workdir, "batches.pt"))
    losses = []
    for step, (images, labels) in enumerate(zip(inputs["images"], inputs["labels"],
                                                strict=True)):
        index = torch.arange(len(images))
        micro = [MicroBatch({"clf": StreamBatch(images=images, labels=labels,
                                                keys=index + step * len(images),
                                                indices=index)}, step=step)]
        result = trainer.train_step_all_ranks(micro, log_now=False)
        losses.append(float(result.losses["clf"]))
    model = trainer.parts.raw_model
    return {"steps": losses,
            "final": {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                      "ema": {k: v.detach().clone() for k, v in
                              trainer.parts.ema.ema_model.state_dict().items()}}}


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------
def summarize(state: Dict[str, torch.Tensor]) -> dict:
    """Per floating tensor [sum, sum |w|] (float64); the classifier head in full."""
    out: dict = {"sums": {}, "head": {}}
    for name, tensor in state.items():
        if tensor.is_floating_point():
            flat = tensor.detach().double().flatten()
            out["sums"][name] = [float(flat.sum()), float(flat.abs().sum())]
            if name in HEAD:
                out["head"][name] = flat.tolist()
    return out


def run_summary(run: dict) -> dict:
    return {"steps": run["steps"],
            "final": {part: summarize(run["final"][part]) for part in ("model", "ema")}}


def differences(a: dict, b: dict) -> Dict[str, object]:
    """|a - b| of two run summaries: the loss at every step ("loss", a list); per part the
    head's elements and each tensor's sums (relative to its sum of |w|), the largest."""
    out: Dict[str, object] = {"loss": [abs(x - y) for x, y in zip(a["steps"], b["steps"],
                                                                   strict=True)]}
    for part in ("model", "ema"):
        fa, fb = a["final"][part], b["final"][part]
        out[f"{part}_head"] = max(abs(x - y) for name in HEAD
                                  for x, y in zip(fa["head"][name], fb["head"][name],
                                                  strict=True))
        out[f"{part}_sums"] = max(abs(x - y) / max(abs(sa[1]), 1e-12)
                                  for name, sa in fa["sums"].items()
                                  for x, y in zip(sa, fb["sums"][name], strict=True))
    return out


def tolerances(spreads: List[Dict[str, object]]) -> Dict[str, object]:
    """10x the largest spread (floor 1e-6); per step for the loss, from the largest spread up to
    that step: two runs part slowly from the first rounding difference, so an early step is
    held to the early spread (a different attack shows from the first step on)."""
    out: Dict[str, object] = {}
    for key, value in spreads[0].items():
        if isinstance(value, list):
            per_step = [max(spread[key][i] for spread in spreads) for i in range(len(value))]
            out[key] = [max(10 * max(per_step[: i + 1]), FLOOR) for i in range(len(value))]
        else:
            out[key] = max(10 * max(spread[key] for spread in spreads), FLOOR)
    return out


def outside(diff: Dict[str, object], tolerance: Dict[str, object]) -> List[str]:
    """The quantities outside their tolerance, as lines (a per-step one: its first step)."""
    lines = []
    for key, bound in tolerance.items():
        if isinstance(bound, list):
            steps = [i for i, (d, b) in enumerate(zip(diff[key], bound, strict=True)) if d > b]
            if steps:
                i = steps[0]
                lines.append(f"{key} at step {i} (and {len(steps) - 1} more): |difference| "
                             f"{diff[key][i]:.3g} > tolerance {bound[i]:.3g}")
        elif diff[key] > bound:
            lines.append(f"{key}: |difference| {diff[key]:.3g} > tolerance {bound:.3g}")
    return lines


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------
def _side(args: List[str], threads: int, cwd: Optional[str] = None, timeout: int = 600,
          extra_env: Optional[dict] = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           **(extra_env or {})}
    if cwd is None:
        env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, os.path.abspath(__file__), *args], cwd=cwd or REPO,
                   env=env, check=True, timeout=timeout)


def measure(original: str, workdir: str, spec: dict) -> dict:
    """Every run of the twin, each in its own process: the stored-file content. The spreads:
    rebm on 1 against 2 threads, and rebm against rebm whose inputs and run both used the
    lowest kernels (`make test-dispatch`'s environment: the initial weights' and batches'
    rounding of another CPU, and its kernels)."""
    from benchmarks.original.trajectory import FORCED_DISPATCH

    job = json.dumps({"workdir": workdir, "spec": spec})
    _side(["inputs", job], 1)
    _side(["original", job], 1, cwd=os.path.join(original, "InNOutRobustness"))
    for threads in (1, 2):
        _side(["rebm", job, str(threads), "argmin_pgd"], threads)
    _side(["rebm", job, "1", "pgd"], 1)
    forced_dir = os.path.join(workdir, "forced_dispatch")
    forced_job = json.dumps({"workdir": forced_dir, "spec": spec})
    _side(["inputs", forced_job], 1, extra_env=FORCED_DISPATCH)
    _side(["rebm", forced_job, "1", "argmin_pgd"], 1, extra_env=FORCED_DISPATCH)

    def load(name):
        return run_summary(torch.load(os.path.join(workdir, name), weights_only=False))

    orig, one, two, plain, forced = (load(n) for n in (
        "original.pt", "rebm_argmin_pgd_1.pt", "rebm_argmin_pgd_2.pt", "rebm_pgd_1.pt",
        os.path.join("forced_dispatch", "rebm_argmin_pgd_1.pt")))
    spreads = {"spread_rebm_1_vs_2_threads": differences(one, two),
               "spread_forced_dispatch": differences(one, forced)}
    return {"original_attack": torch.load(os.path.join(workdir, "original.pt"),
                                          weights_only=False)["attack"],
            "spec": spec, **spreads, "tolerance": tolerances(list(spreads.values())),
            "rebm_vs_original": differences(orig, one),
            "rebm_plain_pgd_vs_original": differences(orig, plain),
            "steps": orig["steps"], "final": orig["final"]}


def _worker(argv: List[str]) -> None:
    role, job = argv[0], json.loads(argv[1])
    workdir, spec = job["workdir"], job["spec"]
    if role == "original":
        torch.set_num_threads(1)
        torch.save(run_original(workdir, spec), os.path.join(workdir, "original.pt"))
        return
    sys.path.insert(0, REPO)
    if role == "inputs":
        write_inputs(workdir, spec)
        return
    threads, attack_type = int(argv[2]), argv[3]
    torch.set_num_threads(threads)
    torch.save(run_rebm(workdir, spec, attack_type),
               os.path.join(workdir, f"rebm_{attack_type}_{threads}.pt"))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.original.stage1",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--original", required=True,
                        help="a checkout of the original DAT code (its InNOutRobustness/)")
    parser.add_argument("--write-reference", metavar="FILE")
    parser.add_argument("--machine", default="", help="the machine, in words, for the file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        result = measure(os.path.abspath(args.original), workdir, SPEC)
    result["machine"] = args.machine
    result["made_by"] = ("python -m benchmarks.original.stage1 --original PATH "
                         "--write-reference tests/data/stage1_twin.json")
    text = json.dumps(result, indent=1)
    if args.write_reference:
        with open(args.write_reference, "w") as fh:
            fh.write(text + "\n")
    tolerance = result["tolerance"]
    print(json.dumps({"rebm_vs_original": outside(result["rebm_vs_original"], tolerance),
                      "rebm_plain_pgd_vs_original": outside(
                          result["rebm_plain_pgd_vs_original"], tolerance),
                      "spread_first_steps": result["spread_rebm_1_vs_2_threads"]["loss"][:5],
                      "dispatch_first_steps": result["spread_forced_dispatch"]["loss"][:5],
                      "plain_pgd_first_steps":
                          result["rebm_plain_pgd_vs_original"]["loss"][:5]}, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("original", "inputs", "rebm"):
        _worker(sys.argv[1:])
    else:
        sys.exit(main())
