"""80M TinyImages without the records the original excludes: its six lists (one counted from 1,
five from 0; InNOutRobustness/utils/datasets/tinyImages.py:59-86 at xuwangyin/DAT fb2ffc7),
read from data.tinyimages_exclusion_dir by default, through the real loader on a tiny_images.bin
in the real on-disk format. A missing or wrong list is a one-line error, never "exclude nothing".
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rebm.config import TrainConfig, plan_batches
from rebm.data.pipeline import DataError, build_train_data, load_outdist
from rebm.data.streams import OUTDIST
from rebm.distributed import Runtime
from rebm.standin.writers import (
    write_fake_cifar10,
    write_tiny_images,
    write_tinyimages_exclusion_lists,
)
from tests.helpers import make_cfg

N_RECORDS = 400
pytestmark = pytest.mark.numbers


def _originals_reading(lists: str) -> np.ndarray:
    """The original's rule written out: 80mn_cifar_idxs.txt minus 1 (tinyImages.py:72-73), the
    five others as they are (lines 76-83), their union (line 85)."""
    numbers = []
    for name in sorted(os.listdir(lists)):
        values = [int(line) for line in open(os.path.join(lists, name))]
        numbers += [v - 1 for v in values] if name == "80mn_cifar_idxs.txt" else values
    return np.unique(numbers)


@pytest.fixture
def tiny(tmp_path):
    """(data folder with tiny_images.bin and TinyImagesExclusionIdcs/, CHW images, excluded)."""
    data = tmp_path / "data"
    write_fake_cifar10(str(data), n_train=48, n_test=8)  # the in-distribution of the run
    chw = write_tiny_images(str(data / "tiny_images.bin"), N_RECORDS)
    excluded = write_tinyimages_exclusion_lists(str(data / "TinyImagesExclusionIdcs"), N_RECORDS)
    return data, chw, excluded


def _cfg(data, **keys):
    cfg = make_cfg(str(data), outdist_dataset="tinyimages", outdist_std_dir=str(data), **keys)
    cfg.data.augm_type_generation = "none"
    return cfg


def test_default_excludes_the_originals_lists(tiny, monkeypatch):
    data, chw, excluded = tiny
    assert TrainConfig().data.tinyimages_exclusion_dir == "./data/TinyImagesExclusionIdcs"
    lists = str(data / "TinyImagesExclusionIdcs")
    assert np.array_equal(excluded, _originals_reading(lists))
    assert {0, N_RECORDS - 1} <= set(excluded.tolist())  # 1-based 1 and N: the first, the last
    monkeypatch.chdir(data.parent)  # the default folder is relative to where the run starts
    cfg = _cfg(data)
    source = load_outdist(cfg.inputs).source
    kept = np.setdiff1d(np.arange(N_RECORDS), excluded)
    assert len(source) == len(kept) == N_RECORDS - len(excluded)
    assert np.array_equal(source.record_numbers(np.arange(len(source))), kept)

    # a training batch of the out-distribution stream: only kept records, read as the original
    raw = np.fromfile(data / "tiny_images.bin", dtype=np.uint8).reshape(N_RECORDS, 3072)
    (micro,) = build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), (OUTDIST,)
                                ).step_batch(3)
    records = source.record_numbers(micro["out"].indices.numpy())
    assert not np.isin(records, excluded).any()
    originals = np.stack([raw[r].reshape(32, 32, 3, order="F") for r in records])
    assert torch.equal(micro["out"].images, torch.from_numpy(originals).permute(0, 3, 1, 2) / 255)
    assert torch.equal(micro["out"].images, torch.from_numpy(chw[records]).float() / 255)


def test_user_index_adds_to_the_lists_and_null_excludes_none(tiny, tmp_path):
    data, _, excluded = tiny
    lists = str(data / "TinyImagesExclusionIdcs")
    np.save(tmp_path / "mine.npy", np.array([[2, 3], [3, 399]]))
    both = _cfg(data, tinyimages_exclusion_dir=lists, outdist_exclude_index=str(tmp_path / "mine.npy"))
    assert len(load_outdist(both.inputs)) == N_RECORDS - len(np.union1d(excluded, [2, 3, 399]))
    assert len(load_outdist(_cfg(data, tinyimages_exclusion_dir=None).inputs)) == N_RECORDS


def _error(cfg) -> str:
    with pytest.raises(DataError) as excinfo:
        load_outdist(cfg.inputs)
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_missing_list_is_a_one_line_error(tiny, tmp_path, monkeypatch):
    data, _, _ = tiny
    monkeypatch.chdir(tmp_path)  # holds data/, but run from elsewhere the default finds nothing
    os.makedirs("elsewhere")
    monkeypatch.chdir("elsewhere")
    message = _error(_cfg(data))
    assert "./data/TinyImagesExclusionIdcs/80mn_cifar_idxs.txt does not exist" in message
    assert "data.tinyimages_exclusion_dir" in message and "xuwangyin/DAT" in message
    lists = data / "TinyImagesExclusionIdcs"
    (lists / "80mn_cifar101_idxs.txt").unlink()  # one of six missing: still an error
    message = _error(_cfg(data, tinyimages_exclusion_dir=str(lists)))
    assert f"{lists}/80mn_cifar101_idxs.txt does not exist" in message


@pytest.mark.parametrize("name,lines,expected", [
    ("80mn_cifar_idxs.txt", "1\n0\n", "counted from 1 must lie in [1, 400]"),  # 0 in a 1-based list
    ("80mn_cifar_idxs.txt", "401\n", "found [401, 401]"),
    ("80mn_cifar10_train_idxs.txt", "400\n", "counted from 0 must lie in [0, 399]"),
    ("80mn_cifar100_test_idxs.txt", "12\nseven\n", "cannot read a list of record numbers"),
])
def test_wrong_list_is_a_one_line_error(tiny, name, lines, expected):
    data, _, _ = tiny
    lists = data / "TinyImagesExclusionIdcs"
    (lists / name).write_text(lines)
    message = _error(_cfg(data, tinyimages_exclusion_dir=str(lists)))
    assert str(lists / name) in message and expected in message, message


ORIGINAL = os.environ.get("REBM_ORIGINAL")  # a checkout of github:xuwangyin/DAT at fb2ffc7


@pytest.mark.skipif(not ORIGINAL, reason="needs a checkout of the original: REBM_ORIGINAL=PATH")
def test_the_originals_own_lists_exclude_200470_records(tmp_path):
    """With the original's lists (its InNOutRobustness/TinyImagesExclusionIdcs) on a sparse
    full-length file: 79,302,017 - 200,470 records, as its loader prints."""
    with open(tmp_path / "tiny_images.bin", "wb") as f:
        f.truncate(79_302_017 * 3072)  # sparse: nothing is written
    lists = os.path.join(ORIGINAL, "InNOutRobustness", "TinyImagesExclusionIdcs")
    source = load_outdist(_cfg(tmp_path, tinyimages_exclusion_dir=lists).inputs).source
    excluded = _originals_reading(lists)
    assert (source.num_excluded, len(source)) == (len(excluded), 79_101_547) == (200_470, 79_101_547)
    records = source.record_numbers(np.arange(0, len(source), 997))
    assert not np.isin(records, excluded).any() and np.all(np.diff(records) > 0)
