"""Precision and recall of the generated samples against real images (registered metric
"precision_recall"; Kynkäänniemi et al. 2019), through torch-fidelity.

The real images are the first `eval.pr_num_real` (default: as many as samples) of the
in-distribution split `eval.pr_reference_split`, at data.image_size without augmentation, in
8 bits; their features and the samples' (torch-fidelity's Inception pool 2048-d, or the
stand-in's) are kept as rows, gathered on every rank, and rank 0 computes torch-fidelity's
`calculate_precision_recall_part` with its default neighbourhood k = 3 (the memory-saving variant
of the library's computation, the same numbers). Precision: the fraction of samples inside the
real images' k-NN balls; recall: the fraction of real images inside the samples' balls. Stored
as "precision" and "recall".
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from rebm.data.sampling import eval_chunks
from rebm.distributed.collectives import decide_on_main
from rebm.distributed.logs import progress
from rebm.eval.fid import feature_problems, standin_key
from rebm.eval.fidelity import (
    FeatureRows,
    chunk_features,
    extract,
    feature_layer,
    fidelity_network_name,
    library_version,
    shared_extractor,
    text_order,
)
from rebm.eval.metric import SAMPLES, EvalContext, Metric, SampleChunk, to_pixels
from rebm.eval.samples import describe_samples, sample_settings

NEIGHBORHOOD = 3  # torch-fidelity's default prc_neighborhood
DISTANCE_BATCH = 10000  # torch-fidelity's default prc_batch_size


def num_real(cfg, split_size: int) -> int:
    wanted = cfg.eval.pr_num_real or cfg.image_log.num_samples
    return min(wanted, split_size)


def real_features(ctx: EvalContext, extractor, layer: str) -> torch.Tensor:
    """Features of the reference images (index order), on every rank: chunk k on rank k % W."""
    from rebm.data.pipeline import load_indist

    rt, cfg = ctx.runtime, ctx.cfg
    dataset = load_indist(cfg, cfg.eval.pr_reference_split, "test")
    total = num_real(cfg, len(dataset))
    rows = FeatureRows()
    chunks = eval_chunks(total, ctx.batch_size, rt.rank, rt.world_size)
    for chunk in progress(chunks, rt, "real features", total=len(chunks)):
        images = torch.stack([dataset[i][0] for i in chunk])
        features = extract(extractor, to_pixels(images).to(rt.device))[layer]
        rows.add(torch.arange(chunk.start, chunk.stop), features)
    return rows.gather(rt, total)


class PrecisionRecall(Metric):
    name = "precision_recall"
    source = SAMPLES

    @classmethod
    def settings(cls, cfg) -> Dict[str, Any]:
        return {"library": library_version(), "neighborhood": NEIGHBORHOOD,
                "features": fidelity_network_name(), "quantized": "8 bit",
                "reference_dataset": cfg.data.indist_dataset,
                "reference_split": cfg.eval.pr_reference_split,
                "num_real": cfg.eval.pr_num_real or "as many as samples",
                **sample_settings(cfg)}

    @classmethod
    def problems(cls, cfg) -> List[str]:
        return feature_problems(cfg.image_log.inception_weights)

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.extractor = shared_extractor(ctx)
        self.layer = feature_layer(self.extractor, "prc")
        self.real = real_features(ctx, self.extractor, self.layer)
        self.rows = FeatureRows()

    def update(self, chunk: SampleChunk) -> None:
        self.rows.add(chunk.indices, chunk_features(chunk, self.extractor)[self.layer])

    def finish(self) -> Dict[str, Any]:
        from torch_fidelity.metric_prc import calculate_precision_recall_part

        total = self.ctx.cfg.image_log.num_samples
        generated = self.rows.gather(self.ctx.runtime, total)[text_order(total)]
        precision, recall = decide_on_main(
            self.ctx.runtime,
            lambda: calculate_precision_recall_part(generated, self.real, NEIGHBORHOOD,
                                                    DISTANCE_BATCH),
            "compute precision and recall")
        return {standin_key("precision"): precision, standin_key("recall"): recall,
                "n_real": int(self.real.shape[0])}

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        standin = settings["features"].startswith("stand-in")
        suffix = "_standin" if standin else ""
        note = ", STAND-IN features" if standin else ""
        where = (f"k = {settings['neighborhood']}, vs {results.get('n_real')} "
                 f"{settings['reference_split']} images; {settings['features']}; "
                 + describe_samples(settings))
        return [(f"precision{note}", f"{results['precision' + suffix]:.4f}", where),
                (f"recall{note}", f"{results['recall' + suffix]:.4f}", where)]
