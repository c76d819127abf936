"""One DAT optimizer step (DESIGN.md §1), and the per-step numbers the loop logs.

Attacks run on the module without DDP (whose forward arms collectives), compiled if it is; the
loss forward/backward goes through the wrapper so gradients are all-reduced. Micro-batches
accumulate under `no_sync()`, so DDP communicates once per optimizer step."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from rebm.attacks.pgd import pgd_from_config
from rebm.distributed import Runtime, all_gather_cat, all_reduce_sum
from rebm.training.config_classes import BatchPlan, TrainConfig, loss_weights
from rebm.training.curriculum import binary_auc
from rebm.training.data import MicroBatch
from rebm.training.modeling import strip_parallel
from rebm.training.objective import dat_loss


class Precision:
    """autocast + (for fp16) GradScaler. bf16 needs no scaler; 'none' is plain fp32."""

    def __init__(self, mode: str, device: torch.device):
        self.mode = mode
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=(mode == "fp16"))

    @classmethod
    def from_config(cls, cfg: TrainConfig, device: torch.device) -> "Precision":
        return cls(cfg.amp, device)

    def autocast(self):
        if self.mode == "none":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.mode == "bf16" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> Optional[dict]:
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state:
            self.scaler.load_state_dict(state)


@dataclass
class StepMetrics:
    """What one step leaves behind on this rank (all detached)."""

    ebm_loss: torch.Tensor  # mean over this rank's images
    clf_loss: torch.Tensor
    in_scores: torch.Tensor  # f_y(x_in), this rank's images, for the curriculum AUC
    adv_scores: torch.Tensor  # f_y(x_adv)
    clean_out_scores: Optional[torch.Tensor]  # f_y(x_out), only when asked
    x_adv_preview: torch.Tensor
    finite: bool
    # Filled in by the loop after the step (global-batch values):
    adv_auc: float = float("nan")
    clean_auc: Optional[float] = None
    outdist_steps: int = 0


@dataclass
class MetricsWindow:
    """Sums since the last metrics log; reduced over ranks only when logged."""

    sums: Dict[str, float] = field(default_factory=lambda: {"ebm": 0.0, "clf": 0.0, "n": 0.0})
    started: float = field(default_factory=time.perf_counter)  # for images/s (not saved)

    def add(self, metrics: StepMetrics) -> None:
        self.sums["ebm"] += float(metrics.ebm_loss)
        self.sums["clf"] += float(metrics.clf_loss)
        self.sums["n"] += 1

    def global_sums(self, runtime: Runtime) -> Dict[str, float]:
        """The window summed over ranks (every rank calls this: an all-reduce)."""
        keys = sorted(self.sums)
        totals = all_reduce_sum(runtime, torch.tensor([self.sums[k] for k in keys],
                                                      dtype=torch.float64))
        return dict(zip(keys, totals.tolist(), strict=True))

    @classmethod
    def restored(cls, global_sums: Dict[str, float], is_main: bool) -> "MetricsWindow":
        """A window resumed from a state: rank 0 carries the global sums, the others start at
        zero, so the next all-reduce counts them once."""
        return cls({k: (v if is_main else 0.0) for k, v in global_sums.items()})

    def summary(self, runtime: Runtime, elapsed_s: float, cfg: TrainConfig, *, adv_auc: float,
                clean_auc: Optional[float], outdist_steps: int) -> Dict[str, float]:
        """Global values: every rank calls this (it all-reduces), rank 0's Tracker writes them."""
        totals = all_reduce_sum(runtime, torch.tensor(
            [self.sums["ebm"], self.sums["clf"], self.sums["n"]], dtype=torch.float64))
        ebm, clf, n = totals.tolist()
        n_steps = n / runtime.world_size
        memory = peak_memory(runtime)
        out = {
            "train_ebm_binary_loss": ebm / n,
            "train_clf_loss": clf / n,
            "train_adv_auc": adv_auc,
            "cur_outdist_steps": outdist_steps,
            "learning_rate": cfg.lr,
            "imgs_per_s": n_steps * cfg.batch_size / max(elapsed_s, 1e-9),
            **memory,
        }
        if clean_auc is not None:
            out["train_clean_auc"] = clean_auc
        return out


def peak_memory(runtime: Runtime) -> Dict[str, float]:
    """Largest per-rank peak RSS (and CUDA max allocated) in MiB; every rank calls this."""
    import resource

    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    values = [rss_mib]
    if runtime.device.type == "cuda":
        values.append(torch.cuda.max_memory_allocated(runtime.device) / 2**20)
    from rebm.distributed import all_reduce_max

    peak = all_reduce_max(runtime, torch.tensor(values, dtype=torch.float64)).tolist()
    out = {"max_rss_mib": peak[0]}
    if len(peak) > 1:
        out["max_cuda_mib"] = peak[1]
    return out


def _fy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """f_y(x) in eval mode, without gradients (AUC scores when they cannot be reused)."""
    with torch.no_grad():
        return model(x).float().gather(1, y[:, None]).squeeze(1)


def dat_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             micro_batches: List[MicroBatch], outdist_steps: int, cfg: TrainConfig,
             plan: BatchPlan, precision: Precision, want_clean_scores: bool = False
             ) -> StepMetrics:
    """Attacks -> losses -> backward over the micro-batches -> one optimizer step."""
    attacked = strip_parallel(model)  # no DDP, still compiled with model.compile
    device = next(attacked.parameters()).device
    frozen_bn = not cfg.model.use_batchnorm  # then train-mode logits equal eval-mode logits
    weights = loss_weights(cfg)
    optimizer.zero_grad(set_to_none=True)
    parts: Dict[str, List[torch.Tensor]] = {k: [] for k in ("ebm", "clf", "in", "adv", "out")}
    for index, batch in enumerate(micro_batches):
        batch = batch.to(device, non_blocking=True)  # pinned by the loader on CUDA
        # Negatives and adversarial examples without DDP, eval mode, input gradients only.
        attacked.eval()
        with precision.autocast():
            x_adv = pgd_from_config(
                attacked, batch.x_out, cfg.attack, steps=outdist_steps, y=batch.y_in,
                objective="lse" if cfg.logsumexp_sampling else "logit",
                random_start_keys=batch.key_out)
            x_c_adv = pgd_from_config(attacked, batch.x_c, cfg.indist_attack_clf, objective="ce",
                                      y=batch.y_c, random_start_keys=batch.key_c)
        if want_clean_scores:
            parts["out"].append(_fy(attacked, batch.x_out, batch.y_in))
        if not frozen_bn:
            parts["in"].append(_fy(attacked, batch.x_in, batch.y_in))
            parts["adv"].append(_fy(attacked, x_adv, batch.y_in))
        model.train()
        last = index == len(micro_batches) - 1
        no_sync = getattr(model, "no_sync", None)
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            with precision.autocast():
                losses = dat_loss(model, batch.x_in, batch.y_in, x_adv, x_c_adv, batch.y_c,
                                  batch.x_out, weights=weights, logsumexp=cfg.logsumexp,
                                  r1reg=cfg.r1reg, fused=frozen_bn)
            precision.backward(losses.loss / plan.accumulation_steps)
        parts["ebm"].append(losses.ebm.bce.detach())
        parts["clf"].append(losses.clf.loss.detach())
        if frozen_bn:  # reuse the loss forward's f_y instead of a second forward
            parts["in"].append(losses.ebm.logit_in)
            parts["adv"].append(losses.ebm.logit_adv)
        if index == 0:
            preview = x_adv
    precision.step(optimizer)
    ebm = torch.stack(parts["ebm"]).mean()
    clf = torch.stack(parts["clf"]).mean()
    return StepMetrics(
        ebm_loss=ebm, clf_loss=clf,
        in_scores=torch.cat(parts["in"]).float(), adv_scores=torch.cat(parts["adv"]).float(),
        clean_out_scores=torch.cat(parts["out"]).float() if parts["out"] else None,
        x_adv_preview=preview.detach(), finite=bool(torch.isfinite(ebm + clf)),
    )


def global_aucs(runtime: Runtime, metrics: StepMetrics) -> tuple:
    """(adv AUC, clean AUC or None) on the all-gathered global batch, so the curriculum does not
    depend on the number of ranks. Every rank calls this with the same `clean` choice."""
    columns = [metrics.in_scores, metrics.adv_scores]
    if metrics.clean_out_scores is not None:
        columns.append(metrics.clean_out_scores)
    scores = all_gather_cat(runtime, torch.stack(columns, dim=1).cpu())
    adv_auc = float(binary_auc(scores[:, 0], scores[:, 1]))
    clean_auc = float(binary_auc(scores[:, 0], scores[:, 2])) if len(columns) > 2 else None
    return adv_auc, clean_auc
