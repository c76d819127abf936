"""The dataset registries: `data.indist_dataset` and `data.outdist_dataset` name a dataset
registered by the module of rebm/data/sets that loads it (one module per dataset family).

Adding a dataset is one module in rebm/data/sets (docs/design.md, extension costs):

    @indist("svhn", num_classes=10)
    def svhn(data, split): return TensorSource(...)      # an ImageSource at data.image_size

    @outdist("svhn")
    def svhn_outdist(inputs, length): return ...

Validation (rebm/config/loading.py) checks the names against these registries, the config takes
a dataset's default `data.num_classes` / `data.image_size` from its entry, and a run's start and
`--check` list the files it reads (`dataset_files`, each with where it comes from), so that all
the missing ones are named at once. The registries (rebm.registry.Registry)
live here, in the config layer, and know the dataset modules only by their package's name: the
first lookup imports rebm.data.sets, so rebm.config never imports rebm.data in code and the
layers hold; importing this module imports no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from rebm.registry import Registry

INDIST_ROLE, OUTDIST_ROLE = "indist", "outdist"


@dataclass(frozen=True)
class InputFile:
    """A file or folder a run reads: the config key that names it, its path, and where it comes
    from (a download address, or the command that makes it)."""

    key: str
    path: str
    source: str

    def missing_line(self) -> str:
        return f"{self.key}: {self.path} does not exist; {self.source}"


def missing_files(files: List[InputFile]) -> List[InputFile]:
    """Those of `files` that do not exist here."""
    return [f for f in files if not os.path.exists(f.path)]


def missing_lines(files: List[InputFile]) -> List[str]:
    """One line per missing file of `files`, or one for a missing folder that would hold
    several of them (a CIFAR folder not extracted yet is one line, not seven)."""
    missing = missing_files(files)
    folders = [os.path.dirname(f.path) for f in missing]
    lines: List[str] = []
    for f, folder in zip(missing, folders, strict=True):
        if folder and folders.count(folder) > 1 and not os.path.isdir(folder):
            line = f"{f.key}: {folder}/ does not exist; {f.source}"
        else:
            line = f.missing_line()
        if line not in lines:
            lines.append(line)
    return lines


# (data section) -> the files the dataset reads under it; None: its folder (or file) alone
FileLister = Callable[[Any], List[InputFile]]


@dataclass(frozen=True)
class DatasetEntry:
    """What the config and the pipeline know of a registered dataset."""

    # in-dist: (data: DataConfig, split) -> ImageSource; out-dist: (inputs: InputSection, length)
    loader: Callable[..., Any]
    reads_files: bool = True  # False: generated or shipped with a package (no folder needed)
    num_classes: Optional[int] = None  # data.num_classes when the config leaves it unset
    image_size: Optional[int] = None  # data.image_size when unset (None: the field's default)
    files: Optional[FileLister] = None  # what it reads inside its folder, for the start's check


DATASET_PACKAGE = "rebm.data.sets"  # where the datasets register themselves
REGISTRIES = {INDIST_ROLE: Registry[DatasetEntry]("data.indist_dataset", DATASET_PACKAGE),
              OUTDIST_ROLE: Registry[DatasetEntry]("data.outdist_dataset", DATASET_PACKAGE)}
INDIST_DATASETS, OUTDIST_DATASETS = REGISTRIES[INDIST_ROLE], REGISTRIES[OUTDIST_ROLE]


def _registrar(registry: Registry[DatasetEntry]):
    def register(name: str, reads_files: bool = True, num_classes: Optional[int] = None,
                 image_size: Optional[int] = None, files: Optional[FileLister] = None
                 ) -> Callable:
        def add(loader: Callable) -> Callable:
            registry.add(name, DatasetEntry(loader, reads_files, num_classes, image_size, files))
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


ROOT_KEYS = {INDIST_ROLE: "data.indist_ds_dir", OUTDIST_ROLE: "data.outdist_std_dir"}


def dataset_files(data, roles: Sequence[str] = (INDIST_ROLE, OUTDIST_ROLE)) -> List[InputFile]:
    """Every file and folder the datasets of `data` (the config's data section) in `roles`
    read, as their modules list them (their folder alone for a module that lists nothing);
    none for a dataset that reads no files."""
    found: List[InputFile] = []
    names = {INDIST_ROLE: data.indist_dataset, OUTDIST_ROLE: data.outdist_dataset}
    for role in roles:
        name = names[role]
        if not dataset_reads_files(role, name):
            continue
        entry = REGISTRIES[role].get(name)
        if entry.files is not None:
            found += entry.files(data)
        else:
            key = ROOT_KEYS[role]
            found.append(InputFile(key, getattr(data, key.split(".")[1]),
                                   f"point {key} at the {name} data (docs/data.md)"))
    return found
