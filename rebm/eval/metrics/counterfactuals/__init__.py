"""Counterfactual explanations: how an image must change for the model to see another class.
The registered metric "counterfactuals" (`Counterfactuals`), with its pieces beside it: the
attack and settings (attack.py), the original's protocol (original.py), the grid (grid.py) and the
per-class statistics (stats.py; the command: python -m rebm.eval.counterfactuals).

Protocols (`eval.counterfactual_protocol`), both by targeted PGD ascent on the target logit with
the generation threat model by default (`image_log`), counterfactuals rounded to 8 bits as the
original's `save_image` wrote them:
- `original` (default; rebm.eval.metrics.counterfactuals.original): every training image (or the first
  `num_images`) toward ONE random other class drawn from (rand_seed, dataset index); FID per
  target class against that class's statistics, the per-class mean confidence averaged over the
  classes.
- `grid` (rebm.eval.metrics.counterfactuals.grid): each of the first `num_images` test images (default
  10) toward every other class (or `num_targets` of them: y+1, y+2, ... mod K).
Per-class statistics (`fid_stats`, a path with `{label}`; rebm.eval.metrics.counterfactuals.stats):
`python -m rebm.eval.counterfactuals CONFIG --class-stats TEMPLATE` (rebm/eval/commands/class_stats.py),
by default of the training split like the original's reference folders. Classes without a file
have no FID.
What both protocols share (settings, the attack, the per-class FID):
rebm.eval.metrics.counterfactuals.attack.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from rebm.config.datasets import indist_root_files
from rebm.config.views import EvaluationSection
from rebm.data.ood_datasets import indist_test_set
from rebm.data.pipeline import loader_workers
from rebm.eval.features.fid import weights_files
from rebm.eval.features.network import network_description, network_key, network_problems
from rebm.eval.metric import TEST_SET, Metric
from rebm.eval.metrics.counterfactuals.attack import (
    COUNTERFACTUAL_PIXELS,
    CounterfactualSettings,
    stats_classes,
)
from rebm.eval.metrics.counterfactuals.grid import (
    evaluate_grid_counterfactuals_all_ranks,
    grid_num_images,
)
from rebm.eval.metrics.counterfactuals.original import (
    evaluate_original_counterfactuals_all_ranks,
    random_targets,
    train_image_set,
)
from rebm.eval.test_set import test_indices, test_set_files, test_set_settings


def counterfactual_settings(evaluation: EvaluationSection) -> CounterfactualSettings:
    """The `eval.counterfactual_*` fields; unset attack fields take `image_log`'s."""
    ev, log = evaluation.eval, evaluation.image_log
    num_images = ev.counterfactual_num_images
    if ev.counterfactual_protocol == "grid":
        num_images = grid_num_images(num_images)
    return CounterfactualSettings(
        protocol=ev.counterfactual_protocol, num_images=num_images,
        num_targets=ev.counterfactual_num_targets,
        steps=log.num_steps if ev.counterfactual_steps is None else ev.counterfactual_steps,
        step_size=(log.step_size if ev.counterfactual_step_size is None
                   else ev.counterfactual_step_size),
        eps=log.eps if ev.counterfactual_eps is None else ev.counterfactual_eps, norm=log.norm,
        fid_stats=ev.counterfactual_fid_stats, image_log=log)


class Counterfactuals(Metric):
    """Counterfactual explanations, by `eval.counterfactual_protocol` (the module docstring);
    previews or grids into <run_dir>/counterfactuals/ when the spec has a run_dir."""

    name = "counterfactuals"
    summary = (("counterfactual_fid", "counterfactual FID", "{:.2f}"),)
    source = TEST_SET
    # 2: the original protocol (training images, one seeded random target each, per-class FID)
    # is the default; settings name the protocol
    protocol = 2

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        cf = counterfactual_settings(evaluation)
        found: Dict[str, Any] = {
            "protocol": cf.protocol, "steps": cf.steps, "step_size": cf.step_size,
            "eps": cf.eps, "norm": cf.norm, "objective": "target logit",
            "pixels": COUNTERFACTUAL_PIXELS}
        if cf.protocol == "original":
            found.update(dataset=evaluation.data.indist_dataset, split="train",
                         num_images=cf.num_images or "all", image_size=evaluation.data.image_size,
                         targets="one random other class per image",
                         target_seed=evaluation.schedule.rand_seed)
        else:
            found.update(test_set_settings(evaluation))  # its num_images: of the test set
            found.update(test_num_images=found["num_images"], num_images=cf.num_images,
                         num_targets=cf.num_targets or "all others")
        if cf.fid_stats:
            found.update(fid_stats=cf.fid_stats, features=network_description(evaluation.image_log),
                         inception_weights=evaluation.image_log.inception_weights)
        return found

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        """The dataset root (and ids file), each class's statistics file and, for Inception
        features, their weights."""
        ev = evaluation.eval
        found: Dict[str, Optional[str]] = (
            indist_root_files(evaluation.data)
            if ev.counterfactual_protocol == "original" else test_set_files(evaluation))
        template = ev.counterfactual_fid_stats
        if template:
            for c in range(evaluation.data.num_classes):
                found[f"eval.counterfactual_fid_stats[{c}]"] = template.format(label=c)
            found.update(weights_files(evaluation.image_log))
        return found

    @classmethod
    def problems(cls, evaluation: EvaluationSection) -> List[str]:
        template = evaluation.eval.counterfactual_fid_stats
        if not template:
            return []
        found = network_problems(evaluation.image_log)
        if not stats_classes(template, evaluation.data.num_classes):
            found.append(f"eval.counterfactual_fid_stats '{template}': no class has a "
                         "statistics file; make them with python -m rebm.eval.counterfactuals "
                         f"CONFIG --class-stats '{template}'")
        return found

    def finish_all_ranks(self) -> Dict[str, Any]:
        ctx, evaluation = self.ctx, self.ctx.evaluation
        folder = ctx.run_dir.counterfactuals if ctx.run_dir is not None else None
        settings = counterfactual_settings(evaluation)
        if settings.protocol == "original":
            sources = train_image_set(evaluation, settings.num_images)
            targets = random_targets(sources.labels(np.arange(len(sources))), sources.indices,
                                     evaluation.data.num_classes, evaluation.schedule.rand_seed)
            results = evaluate_original_counterfactuals_all_ranks(
                ctx.model, sources, targets, settings, ctx.runtime,
                num_classes=evaluation.data.num_classes, batch_size=ctx.batch_size, folder=folder,
                num_workers=loader_workers(evaluation.data, ctx.runtime))
        else:
            sources = indist_test_set(evaluation.data, test_indices(evaluation))
            results = evaluate_grid_counterfactuals_all_ranks(
                ctx.model, sources, settings, ctx.runtime, num_classes=evaluation.data.num_classes,
                batch_size=ctx.batch_size, folder=folder)
        fid_key = network_key(evaluation.image_log, "counterfactual_fid")
        return {(fid_key + key[len("counterfactual_fid"):]
                 if key.startswith("counterfactual_fid") else key): value
                for key, value in results.items()}

    @classmethod
    def describe(cls, results: Dict[str, Any], settings: Dict[str, Any]
                 ) -> List[Tuple[str, str, str]]:
        images = ("training images, one random target each"
                  if settings.get("protocol") == "original" else "test images")
        how = (f"{results['n_counterfactuals']} counterfactuals of {settings['num_images']} "
               f"{images}, {settings['steps']} PGD steps ({settings['norm']}, step "
               f"{settings['step_size']:g}, eps {settings['eps']:g})")
        rows = [("counterfactual confidence", f"{results['counterfactual_confidence']:.4f}", how),
                ("counterfactual success", f"{results['counterfactual_success']:.4f}", how)]
        for key in ("counterfactual_fid", "counterfactual_fid_unverified",
                    "counterfactual_fid_standin"):
            if key in results:
                rows.append((key.replace("_", " "), f"{results[key]:.2f}",
                             f"per-class FID vs {settings['fid_stats']}, mean over classes"))
        return rows
