"""Inception Score of the generated samples (registered metric "inception_score"), through
torch-fidelity.

Every generated chunk's torch-fidelity logits (Inception's `logits_unbiased`, 1008 classes; or
the stand-in's features, rebm/eval/fidelity.py) are kept as rows, gathered in the order
torch-fidelity reads the `keep_samples` folder, and handed to torch-fidelity's
`isc_features_to_metric` with its defaults: 10 splits, rows shuffled with seed 2020. So the value
equals `fidelity --isc --input1 <run_dir>/samples/eval` on the same samples. Stored as
"inception_score" and "inception_score_std" (the std over the splits).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from rebm.eval.fid import feature_problems, standin_key
from rebm.eval.fidelity import (
    FeatureRows,
    chunk_features,
    feature_layer,
    fidelity_network_name,
    library_version,
    shared_extractor,
    text_order,
)
from rebm.eval.metric import SAMPLES, EvalContext, Metric, SampleChunk
from rebm.eval.samples import describe_samples, sample_settings

SPLITS = 10
SHUFFLE_SEED = 2020  # torch-fidelity's default rng_seed


class InceptionScore(Metric):
    name = "inception_score"
    source = SAMPLES

    @classmethod
    def settings(cls, cfg) -> Dict[str, Any]:
        return {"library": library_version(), "splits": SPLITS, "shuffle_seed": SHUFFLE_SEED,
                "features": fidelity_network_name(), "quantized": "8 bit",
                **sample_settings(cfg)}

    @classmethod
    def problems(cls, cfg) -> List[str]:
        return feature_problems(cfg.image_log.inception_weights)

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.key = standin_key("inception_score")
        self.extractor = shared_extractor(ctx)
        self.layer = feature_layer(self.extractor, "isc")
        self.rows = FeatureRows()

    def update(self, chunk: SampleChunk) -> None:
        self.rows.add(chunk.indices, chunk_features(chunk, self.extractor)[self.layer])

    def finish(self) -> Dict[str, Any]:
        from torch_fidelity.metric_isc import isc_features_to_metric

        total = self.ctx.cfg.image_log.num_samples
        logits = self.rows.gather(self.ctx.runtime, total)[text_order(total)]
        score = isc_features_to_metric(logits, splits=SPLITS, shuffle=True, rng_seed=SHUFFLE_SEED)
        return {self.key: score["inception_score_mean"],
                f"{self.key}_std": score["inception_score_std"]}

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        standin = settings["features"].startswith("stand-in")
        key = "inception_score_standin" if standin else "inception_score"
        label = "Inception Score, STAND-IN features" if standin else "Inception Score"
        return [(label, f"{results[key]:.4f} ± {results[f'{key}_std']:.4f}",
                 f"{settings['splits']} splits, {settings['library']}, {settings['features']}; "
                 + describe_samples(settings))]
