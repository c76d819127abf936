"""Typed experiment configuration (docs/design.md §2): schema, legacy fields, loading, batch plan."""

from rebm.config.batch import BatchPlan, eval_batch_size, plan_batches
from rebm.config.identity import RUN_KEYS, default_run_dir, training_diff
from rebm.config.legacy import freeze, ignored_fields_set, legacy_keys
from rebm.config.loading import (
    ConfigError,
    load_config,
    to_dict,
    to_yaml,
    validate,
)
from rebm.config.schema import (
    AttackConfig,
    DataConfig,
    ImageLogConfig,
    ModelConfig,
    TrainConfig,
)

IGNORED_FIELDS = frozenset(legacy_keys(TrainConfig))

__all__ = [
    "IGNORED_FIELDS", "RUN_KEYS", "default_run_dir", "training_diff", "AttackConfig", "BatchPlan", "ConfigError",
    "DataConfig", "ImageLogConfig", "ModelConfig", "TrainConfig", "eval_batch_size", "freeze",
    "ignored_fields_set", "legacy_keys", "load_config", "plan_batches",
    "to_dict", "to_yaml", "validate",
]
