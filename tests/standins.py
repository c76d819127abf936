"""Stand-ins the tests share: rebm's own stand-in for Inception (rebm.eval.standin, named by
REBM_FID_FEATURES in real subprocesses), pytorch-fid's Inception architecture with random weights
(the real file cannot be downloaded here), a fitted head, and every sample of a config in
memory."""

from __future__ import annotations

import torch

from rebm.eval.standin import SPEC as STANDIN
from rebm.eval.standin import features as standin_features

__all__ = ["STANDIN", "standin_features", "random_fid_inception_state", "fit_head",
           "generate_samples"]


def random_fid_inception_state() -> dict:
    """A state dict of pytorch-fid's FID Inception architecture with random weights (the real
    file cannot be downloaded here); the blocks are those of pytorch_fid.inception's
    fid_inception_v3."""
    from pytorch_fid import inception as pf

    net = pf._inception_v3(num_classes=1008, aux_logits=False, weights=None)
    net.Mixed_5b = pf.FIDInceptionA(192, pool_features=32)
    net.Mixed_5c = pf.FIDInceptionA(256, pool_features=64)
    net.Mixed_5d = pf.FIDInceptionA(288, pool_features=64)
    net.Mixed_6b = pf.FIDInceptionC(768, channels_7x7=128)
    net.Mixed_6c = pf.FIDInceptionC(768, channels_7x7=160)
    net.Mixed_6d = pf.FIDInceptionC(768, channels_7x7=160)
    net.Mixed_6e = pf.FIDInceptionC(768, channels_7x7=192)
    net.Mixed_7b = pf.FIDInceptionE_1(1280)
    net.Mixed_7c = pf.FIDInceptionE_2(2048)
    return net.state_dict()


def fit_head(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Least-squares fc on random features, so predictions depend on the input (a random
    WideResNet predicts nearly one class) and the attack has something to flip."""
    with torch.no_grad():
        feats = model.features(x)
        feats = torch.cat([feats, torch.ones(len(feats), 1)], dim=1)
        target = torch.nn.functional.one_hot(y, 10).float() * 10.0
        ridge = 1e-3 * torch.eye(feats.shape[1])
        w = torch.linalg.solve(feats.T @ feats + ridge, feats.T @ target)
        model.fc.weight.copy_(w[:-1].T)
        model.fc.bias.copy_(w[-1])


def generate_samples(model: torch.nn.Module, cfg, runtime=None, num_samples=None,
                     batch_size: int = 128):
    """(images (N, 3, S, S) float [0, 1], labels (N,)) of samples 0..N-1 (N: num_samples, else
    image_log.num_samples), all in memory, for small sets: rebm's SampleGenerator over chunks
    of `batch_size` samples, as an evaluation on one rank generates them (an evaluation streams
    them and keeps none). Rank-local: under several ranks each computes them all."""
    from rebm.distributed import Runtime
    from rebm.eval.passes import eval_mode
    from rebm.eval.sampling.generation import SampleGenerator, balanced_labels
    from rebm.eval.sampling.samples import seed_source

    local = Runtime(device=runtime.device if runtime is not None else torch.device("cpu"))
    n = cfg.image_log.num_samples if num_samples is None else num_samples
    generate = SampleGenerator(model, cfg.evaluation, local, seed_source(cfg.evaluation, {}))
    with eval_mode(generate.model):
        images = [generate(torch.arange(start, min(start + batch_size, n))).images
                  for start in range(0, n, batch_size)]
    size = cfg.data.image_size
    return (torch.cat(images) if images else torch.zeros(0, 3, size, size),
            balanced_labels(torch.arange(n), cfg.data.num_classes))


def register_standin() -> str:
    """Register rebm's stand-in with torch-fidelity, so a test can call the library itself with
    the same features rebm computes; returns its name."""
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

    from rebm.eval.features.fidelity import STANDIN_NAME, _standin_class

    if STANDIN_NAME not in FEATURE_EXTRACTORS_REGISTRY:
        register_feature_extractor(STANDIN_NAME, _standin_class())
    return STANDIN_NAME



def write_standin_statistics(path, mu, sigma) -> None:
    """FID reference statistics of the stand-in's features, recorded as such (as
    `REBM_FID_FEATURES=rebm.eval.standin:features python -m rebm.eval.fid_stats` writes them)."""
    from rebm.eval.features.fid import write_statistics

    write_statistics(str(path), mu, sigma, f"stand-in {STANDIN}", "test")
