"""80M TinyImages: tiny_images.bin (data.outdist_std_dir, the file or its folder), read through a
memory map, without the records the original excludes and those of data.outdist_exclude_index.

The original's exclusion (xuwangyin/DAT fb2ffc7): stage 2 builds its TinyImages set with
`exclude_cifar=True, exclude_cifar10_1=True` (rebm/training/data.py:170-172), which reads six
lists from InNOutRobustness/TinyImagesExclusionIdcs/ (InNOutRobustness/utils/datasets/
tinyImages.py:59-86): 80mn_cifar_idxs.txt counts records from 1 (its loader subtracts 1,
lines 72-73), the other five from 0; their union, 200,470 records, is left out (lines 110-112).
The lists are not shipped with rebm (no licence covers them); data.tinyimages_exclusion_dir
names the folder of a copy (docs/data.md says how to get it).
"""

from __future__ import annotations

import logging
import os
from typing import List

import numpy as np

from rebm.config import DataConfig
from rebm.config.datasets import InputFile, outdist
from rebm.config.views import InputSection
from rebm.data.sources import DataError, TinyImagesSource, one_line, tinyimages_record_count

LOGGER = logging.getLogger(__name__)

TINYIMAGES_FILE = "tiny_images.bin"
ORIGINAL_LISTS_FOLDER = "InNOutRobustness/TinyImagesExclusionIdcs"
ORIGINAL_REPOSITORY = "https://github.com/xuwangyin/DAT"
# the copy the original's README names (README.md:15); rebm does not download it
TINYIMAGES_ADDRESS = "http://www.archive.org/download/80-million-tiny-images-2-of-2/tiny_images.bin"
# (file, the number its records start from), in the order tinyImages.py:62-83 reads them
ORIGINAL_EXCLUSION_LISTS = (
    ("80mn_cifar_idxs.txt", 1),
    ("80mn_cifar10_test_idxs.txt", 0),
    ("80mn_cifar100_test_idxs.txt", 0),
    ("80mn_cifar10_train_idxs.txt", 0),
    ("80mn_cifar100_train_idxs.txt", 0),
    ("80mn_cifar101_idxs.txt", 0),
)


def tinyimages_path(data: DataConfig) -> str:
    """data.outdist_std_dir names tiny_images.bin or the folder that holds it."""
    path = data.outdist_std_dir
    return os.path.join(path, TINYIMAGES_FILE) if os.path.isdir(path) else path


def tinyimages_files(data: DataConfig) -> List[InputFile]:
    """tiny_images.bin, the original's six exclusion lists and data.outdist_exclude_index."""
    files = [InputFile("data.outdist_std_dir", tinyimages_path(data),
                       f"download {TINYIMAGES_ADDRESS} (227 GiB) into it")]
    if data.tinyimages_exclusion_dir is not None:
        folder = data.tinyimages_exclusion_dir
        source = (f"copy {ORIGINAL_LISTS_FOLDER}/ of the original ({ORIGINAL_REPOSITORY}) to "
                  f"{folder} (null excludes no record, unlike the paper)")
        files += [InputFile("data.tinyimages_exclusion_dir", os.path.join(folder, name), source)
                  for name, _ in ORIGINAL_EXCLUSION_LISTS]
    if data.outdist_exclude_index:
        files.append(InputFile("data.outdist_exclude_index", data.outdist_exclude_index,
                               "write the record numbers to exclude there, or set it to null"))
    return files


@outdist("80m-tinyimages", files=tinyimages_files)
@outdist("tinyimages", files=tinyimages_files)
def tinyimages(inputs: InputSection, _length) -> TinyImagesSource:
    data = inputs.data
    path = tinyimages_path(data)
    num_records = tinyimages_record_count(path)
    parts: List[np.ndarray] = []
    if data.tinyimages_exclusion_dir is not None:
        parts += original_exclusion(data.tinyimages_exclusion_dir, num_records)
    if data.outdist_exclude_index:
        parts.append(user_exclusion(data.outdist_exclude_index, num_records))
    excluded = sorted_unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    LOGGER.info("80M TinyImages %s: %d records, %d excluded (lists: %s; "
                "data.outdist_exclude_index: %s)", path, num_records, len(excluded),
                data.tinyimages_exclusion_dir, data.outdist_exclude_index)
    return TinyImagesSource(path, data.image_size, excluded)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique by sorting: numpy 2's hash-based unique took 0.7 s on the 320k numbers of the
    six lists, a sort takes 20 ms."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if values.size else values


def original_exclusion(folder: str, num_records: int) -> List[np.ndarray]:
    """The original's six lists in `folder`, each as 0-based record numbers."""
    return [read_record_list(os.path.join(folder, name), base, num_records)
            for name, base in ORIGINAL_EXCLUSION_LISTS]


def read_record_list(path: str, base: int, num_records: int) -> np.ndarray:
    """One list of the original: an integer per line, counted from `base`; 0-based numbers."""
    if not os.path.isfile(path):
        raise DataError(
            f"TinyImages exclusion list {path} does not exist (data.tinyimages_exclusion_dir); "
            f"copy {ORIGINAL_LISTS_FOLDER}/ of the original ({ORIGINAL_REPOSITORY}) to "
            f"{os.path.dirname(path) or '.'} or point data.tinyimages_exclusion_dir at it "
            "(null excludes no record, unlike the paper)")
    try:
        values = np.loadtxt(path, dtype=np.int64, ndmin=1)
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: cannot read a list of record numbers ({one_line(err)}); "
                        f"restore it from {ORIGINAL_LISTS_FOLDER}/ of the original") from None
    if values.size and (values.min() < base or values.max() >= num_records + base):
        raise DataError(
            f"{path}: record numbers counted from {base} must lie in [{base}, "
            f"{num_records + base - 1}] for a file of {num_records} records, found "
            f"[{values.min()}, {values.max()}]; use the whole tiny_images.bin (79,302,017 "
            "records) and the original's lists, or set data.tinyimages_exclusion_dir=null")
    return values - base


def user_exclusion(path: str, num_records: int) -> np.ndarray:
    """data.outdist_exclude_index: 0-based record numbers in a .npy (any shape) or a text file
    read by numpy.loadtxt (`#` comments)."""
    if not os.path.isfile(path):
        raise DataError(f"exclusion index {path} does not exist (data.outdist_exclude_index)")
    try:
        if path.lower().endswith(".npy"):
            values = np.load(path, allow_pickle=False)
        else:
            values = np.loadtxt(path, dtype=np.int64, ndmin=1, comments="#")
    except Exception as err:
        raise DataError(f"{path}: cannot read exclusion index ({one_line(err)}); use a .npy "
                        "or a text file of integers") from None
    values = sorted_unique(np.asarray(values, dtype=np.int64).ravel())
    if values.size and (values[0] < 0 or values[-1] >= num_records):
        raise DataError(f"{path}: record numbers must lie in [0, {num_records}) (0-based), found "
                        f"[{values[0]}, {values[-1]}]; a 1-based list (like the original "
                        "80mn_cifar_idxs.txt) needs 1 subtracted (data.outdist_exclude_index)")
    return values

