"""Bad data gets one clear line naming the path: missing or corrupt CIFAR, empty folders,
truncated TinyImages, malformed tensor files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rebm.data.pipeline import DataError, image_tensor_file, load_indist, load_outdist
from rebm.standin.writers import write_fake_cifar10
from tests.helpers import make_cfg


# --------------------------------------------------------------------------------------------
# Clear errors
# --------------------------------------------------------------------------------------------
def _assert_one_line_error(excinfo, path):
    message = str(excinfo.value)
    assert "\n" not in message and str(path) in message, message


def test_missing_cifar_root(tmp_path):
    with pytest.raises(DataError) as excinfo:
        load_indist(make_cfg(str(tmp_path / "nowhere")).data, "train")
    _assert_one_line_error(excinfo, tmp_path / "nowhere" / "cifar-10-batches-py")
    assert "data.download=true" in str(excinfo.value)


def test_corrupt_cifar_pickle(tmp_path):
    folder = write_fake_cifar10(str(tmp_path), n_train=10, n_test=5)
    bad = os.path.join(folder, "data_batch_3")
    with open(bad, "wb") as f:
        f.write(b"this is not a pickle")
    with pytest.raises(DataError) as excinfo:
        load_indist(make_cfg(str(tmp_path)).data, "train")
    _assert_one_line_error(excinfo, bad)


def test_empty_image_folder(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    cfg = make_cfg(str(tmp_path), indist_dataset="imagefolder")
    with pytest.raises(DataError) as excinfo:
        load_indist(cfg.data, "train")
    _assert_one_line_error(excinfo, tmp_path / "train")
    cfg = make_cfg(str(tmp_path), outdist_dataset="imagefolder",
                   outdist_std_dir=str(tmp_path / "train"))
    with pytest.raises(DataError) as excinfo:
        load_outdist(cfg.inputs)
    _assert_one_line_error(excinfo, tmp_path / "train")


def test_wrong_tinyimages_size(tmp_path):
    path = tmp_path / "tiny_images.bin"
    path.write_bytes(b"\0" * (3072 * 2 + 5))
    cfg = make_cfg(str(tmp_path), outdist_dataset="80m-tinyimages",
                   outdist_std_dir=str(tmp_path))
    with pytest.raises(DataError) as excinfo:
        load_outdist(cfg.inputs)
    _assert_one_line_error(excinfo, path)


def test_bad_tensor_file(tmp_path):
    path = tmp_path / "bad.npy"
    np.save(path, np.zeros((4, 5, 6, 7), dtype=np.uint8))
    with pytest.raises(DataError) as excinfo:
        image_tensor_file(str(path))
    _assert_one_line_error(excinfo, path)
    np.save(path, np.full((2, 3, 4, 4), 7.0, dtype=np.float32))
    with pytest.raises(DataError, match=r"\[0, 1\]"):
        image_tensor_file(str(path))


def test_grey_float_tensor_file_loads(tmp_path):
    path = tmp_path / "grey.npy"
    np.save(path, np.full((3, 1, 4, 4), 0.5, dtype=np.float32))
    images = image_tensor_file(str(path))
    assert images.shape == (3, 3, 4, 4) and float(images.max()) == 0.5
