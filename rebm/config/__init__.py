"""Typed experiment configuration (docs/design.md §2): schema, legacy fields, loading, batch plan."""

from rebm.config.aliases import ALIASES
from rebm.config.batch import BatchPlan, eval_batch_size, plan_batches
from rebm.config.errors import ConfigError
from rebm.config.frozen import explicit_keys, freeze
from rebm.config.identity import RUN_KEYS, default_run_dir, training_diff
from rebm.config.layout import replace
from rebm.config.legacy import ignored_fields_notice, ignored_fields_set, legacy_keys
from rebm.config.loading import (
    load_config,
    to_dict,
    to_yaml,
    validate,
    yaml_of,
)
from rebm.config.schema import (
    DataConfig,
    ImageLogConfig,
    ModelConfig,
    TrainConfig,
)
from rebm.config.sections import AttackConfig

IGNORED_FIELDS = frozenset(legacy_keys(TrainConfig))

__all__ = [
    "ALIASES", "IGNORED_FIELDS", "RUN_KEYS", "default_run_dir",
    "training_diff", "AttackConfig", "BatchPlan", "ConfigError", "DataConfig", "ImageLogConfig",
    "ModelConfig", "TrainConfig", "eval_batch_size", "explicit_keys", "freeze", "replace",
    "ignored_fields_notice", "ignored_fields_set", "legacy_keys", "load_config", "plan_batches",
    "to_dict", "to_yaml", "validate", "yaml_of",
]
