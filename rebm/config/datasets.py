"""The dataset registries: `data.indist_dataset` and `data.outdist_dataset` name a dataset
registered by the module of rebm/data/sets that loads it (one module per dataset family).

Adding a dataset is one module in rebm/data/sets (docs/design.md, extension costs):

    @indist("svhn", num_classes=10)
    def svhn(data, split): return TensorSource(...)      # an ImageSource at data.image_size

    @outdist("svhn")
    def svhn_outdist(inputs, length): return ...

Validation (rebm/config/loading.py) checks the names against these registries, the config takes
a dataset's default `data.num_classes` / `data.image_size` from its entry, and `--check` asks
`dataset_reads_files` whether a missing folder matters. The registries (rebm.registry.Registry)
live here, in the config layer, and know the dataset modules only by their package's name: the
first lookup imports rebm.data.sets, so rebm.config never imports rebm.data in code and the
layers hold; importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from rebm.registry import Registry

INDIST_ROLE, OUTDIST_ROLE = "indist", "outdist"


@dataclass(frozen=True)
class DatasetEntry:
    """What the config and the pipeline know of a registered dataset."""

    # in-dist: (data: DataConfig, split) -> ImageSource; out-dist: (inputs: InputSection, length)
    loader: Callable[..., Any]
    reads_files: bool = True  # False: generated or shipped with a package (no folder needed)
    num_classes: Optional[int] = None  # data.num_classes when the config leaves it unset
    image_size: Optional[int] = None  # data.image_size when unset (None: the field's default)


DATASET_PACKAGE = "rebm.data.sets"  # where the datasets register themselves
REGISTRIES = {INDIST_ROLE: Registry[DatasetEntry]("data.indist_dataset", DATASET_PACKAGE),
              OUTDIST_ROLE: Registry[DatasetEntry]("data.outdist_dataset", DATASET_PACKAGE)}
INDIST_DATASETS, OUTDIST_DATASETS = REGISTRIES[INDIST_ROLE], REGISTRIES[OUTDIST_ROLE]


def _registrar(registry: Registry[DatasetEntry]):
    def register(name: str, reads_files: bool = True, num_classes: Optional[int] = None,
                 image_size: Optional[int] = None) -> Callable:
        def add(loader: Callable) -> Callable:
            registry.add(name, DatasetEntry(loader, reads_files, num_classes, image_size))
            return loader
        return add
    return register


indist = _registrar(INDIST_DATASETS)  # decorator: an in-distribution dataset, loader(data, split)
# decorator: an out-distribution dataset, loader(inputs, length)
outdist = _registrar(OUTDIST_DATASETS)


def dataset_reads_files(role: str, name: str) -> bool:
    """Whether dataset `name` of `role` ('indist' or 'outdist') reads its own folder or file
    (data.indist_ds_dir / data.outdist_std_dir), so that its absence is worth a warning."""
    registry = REGISTRIES[role]
    return name in registry and registry.get(name).reads_files


def indist_root_files(data) -> Dict[str, Optional[str]]:
    """The in-distribution root as an entry of a file list (`Metric.files`, the samples' files,
    `--check`): {'data.indist_ds_dir': root}, or nothing for a dataset that reads no files
    (digits come with scikit-learn), which `--check` must not report missing. `data` is the
    config's data section."""
    if dataset_reads_files(INDIST_ROLE, data.indist_dataset):
        return {"data.indist_ds_dir": data.indist_ds_dir}
    return {}
