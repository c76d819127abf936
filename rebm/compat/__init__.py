"""The compatibility boundary: what rebm keeps only so that the original DAT code's files, names
and states keep working. Each module says which original behaviour it serves:

- config_fields: the original configs' fields that do nothing here (accepted, named at start-up,
  or refused with the reason), so its experiment files load unchanged;
- aliases: the original configs' other spellings of rebm's fields (`fp16`, `resume_path`,
  `image_log.ood_data_dir`);
- state_format: training states of the first layout (format 1, and stage 1's list-shaped metrics
  window) read into today's;
- and, outside the package, rebm/training/modeling.py: get_model / get_optimizer /
  load_checkpoint with the original's signatures at the original's import path, for scripts
  written against it (it calls the checkpoint loader, the models and the optimizers, so it sits in
  the top layer, where the original's path puts it anyway).

The package is one layer (pyproject.toml), below rebm.config and rebm.checkpoint, which apply
its declarations; it imports nothing of rebm.
"""
