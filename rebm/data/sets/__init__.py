"""The datasets `data.indist_dataset` / `data.outdist_dataset` name, one module per family; each
registers its loaders in rebm.config.datasets (which imports this package on its first lookup).
A new dataset is a new module here."""
