"""docs/data.md and the quickstart configs against what they describe: the `--check` example's
warnings are the documented command's own, the quickstart's stage-1 config names the file its
stage 2 reads, and, with a checkout of the original (REBM_ORIGINAL=PATH, github:xuwangyin/DAT at
fb2ffc7), the TinyImages exclusion table counts the original's files and the lines cited from
the original's code hold what the text says."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import yaml

from tests.helpers import REPO, base_env, finish
from tests.processes import popen

DOC = REPO / "docs" / "data.md"
ORIGINAL = os.environ.get("REBM_ORIGINAL")  # a checkout of github:xuwangyin/DAT at fb2ffc7
needs_original = pytest.mark.skipif(not ORIGINAL,
                                    reason="needs a checkout of the original: REBM_ORIGINAL=PATH")


def check_example() -> Tuple[List[str], List[str]]:
    """The `--check` example of docs/data.md: (its command's words after `$ `, its warning
    lines)."""
    text = DOC.read_text()
    block = re.search(r"```\n\$ (.*? --check)\n(.*?)```", text, re.S)
    assert block, "docs/data.md has no `$ ... --check` example"
    warnings = [line for line in block.group(2).splitlines() if line.startswith("warning:")]
    return block.group(1).split(), warnings


@pytest.mark.slow
def test_the_check_examples_warnings_are_the_commands_own(tmp_path):
    """Run where nothing of the config exists (a fresh folder: its paths are relative): every
    warning the example shows is printed, the checkpoint path as the recipe names it."""
    words, warnings = check_example()
    assert words[0].endswith("python") and words[1:3] == ["-m", "rebm.training.train"], words
    assert warnings, "the example shows no warning"
    config = REPO / words[3]
    command = [sys.executable, *words[1:3], str(config), *words[4:]]
    code, output = finish(popen(command, base_env(), tmp_path), timeout=120)
    assert code == 0, output[-3000:]
    lines = output.splitlines()
    for warning in warnings:  # "..." in the example stands for what the machine fills in
        pattern = re.compile(".*".join(map(re.escape, warning.split("..."))))
        assert any(pattern.fullmatch(line) for line in lines), (warning, output[-3000:])
    ckpt = yaml.safe_load(config.read_text())["model"]["ckpt_path"]
    assert f"warning: model.ckpt_path '{ckpt}' does not exist here" in warnings


def test_quickstart_stage1_names_the_checkpoint_stage2_reads():
    """digits_stage1.yaml's header says which of its files starts stage 2: the file and the path
    are digits_stage2.yaml's model.ckpt_path, in the folder `make quickstart` gives stage 1."""
    folder = REPO / "experiments" / "quickstart"
    ckpt = yaml.safe_load((folder / "digits_stage2.yaml").read_text())["model"]["ckpt_path"]
    header = " ".join(line.lstrip("# ") for line in (folder / "digits_stage1.yaml").read_text()
                      .splitlines() if line.startswith("#"))
    named = set(re.findall(r"model_\w+\.pth", header))
    assert named == {Path(ckpt).name}, (named, ckpt)
    assert ckpt in header
    quickstart = (REPO / "Makefile").read_text().split("\nquickstart:", 1)[1].split("\n\n")[0]
    stage1 = next(line for line in quickstart.splitlines() if "train_at.py" in line)
    assert f"run_dir={Path(ckpt).parent}" in stage1.split(), stage1


def exclusion_table() -> Dict[str, Tuple[int, int]]:
    """{list file: (numbers, unique numbers)} of docs/data.md's exclusion table."""
    rows = re.findall(r"^\| `(80mn_\w+\.txt)` \| [^|]* \| ([\d,]+) \(([\d,]+)\) \|$",
                      DOC.read_text(), re.M)
    return {name: (int(total.replace(",", "")), int(unique.replace(",", "")))
            for name, total, unique in rows}


@needs_original
def test_the_exclusion_table_counts_the_originals_files():
    folder = Path(ORIGINAL) / "InNOutRobustness" / "TinyImagesExclusionIdcs"
    table = exclusion_table()
    assert set(table) == {p.name for p in folder.glob("80mn_*.txt")}
    union = set()
    for name, (total, unique) in table.items():
        numbers = [int(line) for line in (folder / name).read_text().split()]
        assert (len(numbers), len(set(numbers))) == (total, unique), name
        union |= {n - 1 if name == "80mn_cifar_idxs.txt" else n for n in numbers}
    assert f"union is {len(union):,} records" in " ".join(DOC.read_text().split())


# (file of the original, first and last line cited, what those lines hold) for the seed images
# of generation: the grid reads 10 rows, every FID loads the file and uses num_samples rows
SEED_CITATIONS = [
    ("rebm/eval/eval_utils.py", 117, 120, ["torch.load(cfg.image_log.ood_data_dir", ":samples"]),
    ("rebm/training/train.py", 544, 548, ["log_generate_images(", "samples=10"]),
    ("rebm/eval/eval_utils.py", 401, 403, ["torch.load(fid_cfg.ood_data_dir", "TensorDataset"]),
    ("rebm/eval/eval_utils.py", 425, 426, ["fid_cfg.num_samples / batch_size",
                                           "total_samples = fid_cfg.num_samples"]),
    ("rebm/eval/eval_utils.py", 450, 460, ["total_samples - samples_saved",
                                           "seed_imgs[:remaining_samples]"]),
]


def test_the_seed_image_citations_are_in_the_doc():
    text = " ".join(DOC.read_text().split())
    for path, first, last, _ in SEED_CITATIONS:
        cited = f"{first}-{last}"
        assert f"`{path}:{cited}`" in text or f"`:{cited}`" in text or \
            f"`{Path(path).name}:{cited}`" in text, (path, cited)


@needs_original
@pytest.mark.parametrize("path, first, last, holds", SEED_CITATIONS)
def test_the_cited_lines_of_the_original_hold_what_the_doc_says(path, first, last, holds):
    lines = (Path(ORIGINAL) / path).read_text().splitlines()[first - 1:last]
    cited = "".join(line.strip() for line in lines)
    for fragment in holds:
        assert fragment in cited, (path, first, last, fragment)
