"""The compatibility boundary: what rebm keeps only so that the original DAT code's files, names
and states keep working. Each module says which original behaviour it serves:

- config_fields: the original configs' fields that do nothing here (accepted, named at start-up,
  or refused with the reason), so its experiment files load unchanged;
- aliases: the original configs' other spellings of rebm's fields (`fp16`, `resume_path`,
  `image_log.ood_data_dir`);
- state_format: training states of the first layout (format 1, and stage 1's list-shaped metrics
  window) read into today's;
- modeling: `rebm.training.modeling`'s get_model / get_optimizer / load_checkpoint with the
  original's signatures, for scripts written against it.

The package imports none of them: each sits in the layer of what it serves (pyproject.toml),
config_fields, aliases and state_format below rebm.config, modeling above rebm.checkpoint.
"""
