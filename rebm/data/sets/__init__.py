"""The datasets `data.indist_dataset` / `data.outdist_dataset` name, one module per family; each
registers its loaders in rebm.config.datasets (which imports this package on its first lookup).
A loader takes the section it reads: an in-distribution one `(data: DataConfig, split)`, an
out-distribution one `(inputs: InputSection, length)` (OpenImage-O's sample cap and noise's seed
are top-level keys). A new dataset is a new module here."""
