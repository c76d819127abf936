"""Baseline for the quickstart's robustness claim: the same WideResNet trained normally (plain
cross-entropy, no adversarial training, no energy term) on the same digits, evaluated with the
same robust-accuracy attack as the quickstart (PGD with its indist_attack_clf threat model and
robust_eval_steps).

    .venv/bin/python benchmarks/quickstart_baseline.py [CONFIG] [key=value ...]

CONFIG defaults to experiments/quickstart/digits_stage1.yaml (live BatchNorm, SGD, 10 epochs):
the stage-1 recipe without the attack, i.e. a normally trained model of the same size.
prints one JSON line: {"test_acc": ..., "robust_test_acc": ..., "eps": ..., "steps": ...}
"""

import json
import sys

import torch
import torch.nn.functional as F

from rebm.config import eval_batch_size, load_config
from rebm.data import load_indist
from rebm.distributed import Runtime
from rebm.engine.optimizers import build_optimizer
from rebm.eval.evaluator import Evaluator
from rebm.eval.registry import standard_metrics
from rebm.models import model_from_config


def main(argv):
    path = argv[0] if argv and "=" not in argv[0] else "experiments/quickstart/digits_stage1.yaml"
    overrides = [a for a in argv if "=" in a]
    cfg = load_config(path, overrides)
    torch.manual_seed(cfg.schedule.rand_seed)
    model = model_from_config(cfg.model, cfg.data)
    optimizer = build_optimizer(cfg.optimization, model.parameters())
    train = load_indist(cfg.data, "train", augm="none")
    loader = torch.utils.data.DataLoader(train, batch_size=cfg.schedule.batch_size, shuffle=True,
                                         drop_last=True)
    model.train()
    for _ in range(cfg.schedule.total_epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    runtime = Runtime()
    evaluator = Evaluator(cfg.evaluation, runtime, standard_metrics(cfg.evaluation, samples=False))
    metrics = evaluator.evaluate_all_ranks(model).values
    attack = cfg.method.indist_attack_clf
    metrics.update(eps=attack.eps, norm=attack.norm,
                   steps=cfg.eval.robust_eval_steps or attack.max_steps,
                   eval_batch=eval_batch_size(cfg.schedule, cfg.eval, runtime.world_size))
    print(json.dumps(metrics))


if __name__ == "__main__":
    main(sys.argv[1:])
