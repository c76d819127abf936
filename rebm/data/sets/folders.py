"""Datasets that are a folder or a file the user points at: image folders (labelled by
sub-folder for the in-distribution: <indist_ds_dir>/<split>/<class>/...), OpenImage-O and
tensor files (out-distribution, data.outdist_std_dir)."""

from __future__ import annotations

import os
from typing import List

from rebm.config import DataConfig
from rebm.config.datasets import InputFile, indist, outdist
from rebm.config.views import InputSection
from rebm.data.files import load_labelled_folder, load_tensor_file, load_unlabelled_folder
from rebm.data.imagenet import load_openimage_o
from rebm.data.sources import ImageSource


def labelled_folder_files(data: DataConfig) -> List[InputFile]:
    """The two splits' folders."""
    return [InputFile("data.indist_ds_dir", os.path.join(data.indist_ds_dir, split),
                      "put the split's images there as <class>/<image> (docs/data.md)")
            for split in ("train", "test")]


@indist("imagefolder", files=labelled_folder_files)
def labelled_folder(data: DataConfig, split: str) -> ImageSource:
    return load_labelled_folder(os.path.join(data.indist_ds_dir, split), data.image_size)


@outdist("imagefolder")
def unlabelled_folder(inputs: InputSection, _length) -> ImageSource:
    return load_unlabelled_folder(inputs.data.outdist_std_dir, inputs.data.image_size)


@outdist("OpenImageO")
def openimage_o(inputs: InputSection, _length) -> ImageSource:
    return load_openimage_o(inputs.data.outdist_std_dir, inputs.data.image_size,
                            inputs.data.openimages_max_samples)


@outdist("tensorfile")
def tensor_file(inputs: InputSection, _length) -> ImageSource:
    return load_tensor_file(inputs.data.outdist_std_dir, inputs.data.image_size)
