"""DAT's two attacks of a micro-batch: negatives x_adv = PGD_T(x_out) (f_y, or logsumexp with
`logsumexp_sampling`, threat model `attack`) and the adversarial classifier batch
x_c_adv = PGD_K^CE(x_c) (threat model `indist_attack_clf`), run separately or, with
`fuse_attacks`, as one batched pass while both run (rebm.attacks.fused)."""

from __future__ import annotations

from typing import Tuple, Union

import torch

from rebm.attacks.fused import pgd_attack_streams
from rebm.attacks.pgd import pgd_attack_stream, stream_from_config
from rebm.data import CLASSIFIER, INDIST, OUTDIST, MicroBatch


def resolve_fuse_attacks(setting: Union[bool, str], device: torch.device) -> bool:
    """`fuse_attacks` true/false as given; "auto": on for CUDA, off elsewhere.

    On a GPU each attack's small per-device batch leaves the device underfed and pays its own
    kernel launches: fused, the two attacks took 0.51-0.66x their separate time on an H100
    (T = K = 10, 16-128 images per stream). On a CPU two threads are already busy with 32
    images, and the fused pass measured 1.02-1.07x on an idle machine (docs/performance.md)."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


def dat_attacks(model: torch.nn.Module, cfg, outdist_steps: int, batch: MicroBatch,
                fuse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x_adv, x_c_adv) of one micro-batch on `model` (the attacked module, in the mode the
    caller set); the negatives' labels are the in-distribution ones."""
    out, clf = batch[OUTDIST.name], batch[CLASSIFIER.name]
    negatives = stream_from_config(
        out.images, cfg.attack, steps=outdist_steps, y=batch[INDIST.name].labels,
        objective="lse" if cfg.logsumexp_sampling else "logit", random_start_keys=out.keys)
    classifier = stream_from_config(clf.images, cfg.indist_attack_clf, objective="ce",
                                    y=clf.labels, random_start_keys=clf.keys)
    if fuse:
        x_adv, x_c_adv = pgd_attack_streams(model, [negatives, classifier])
    else:
        x_adv, x_c_adv = pgd_attack_stream(model, negatives), pgd_attack_stream(model, classifier)
    return x_adv, x_c_adv
