"""Every numeric key has a range its consumer can hold, checked when the config loads: a value
outside it is one line naming the key, at `--check` and at the start of a run, before anything
is written (rebm/config/ranges.py). The sweep is generated from the config's fields."""

from __future__ import annotations

import sys

import pytest

from rebm.config import TrainConfig
from rebm.config.ranges import numeric_keys
from rebm.training import train
from tests.helpers import CONFIG, run_command

FIELDS = [(key, kind, listed) for key, kind, listed, _ in numeric_keys(TrainConfig())]


def _absurd(kind: type, listed: bool) -> str:
    """A value no consumer of the key can hold: beyond int64, or beyond float32 (yet a finite
    float64, which OmegaConf takes)."""
    value = str(10**30) if kind is int else "1e300"
    return f"[{value}]" if listed else value


def _refusal(capsys, argv) -> str:
    """The one error line of the training entry point on `argv`, in this process."""
    with pytest.raises(SystemExit) as exited:
        train.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_the_sweep_covers_every_numeric_field_of_every_section():
    sections = {key.split(".")[0] for key, _, _ in FIELDS if "." in key}
    assert {"data", "attack", "indist_attack_clf", "model", "image_log", "eval"} <= sections
    keys = {key for key, _, _ in FIELDS}
    assert {"lr", "rand_seed", "ddp_timeout_s", "ddp_step_timeout_s", "batch_size",
            "image_log.step_sweep_range"} <= keys


@pytest.mark.slow
@pytest.mark.parametrize("check", [True, False], ids=["check", "run"])
def test_an_absurdly_large_value_of_any_numeric_key_is_one_line_naming_it(capsys, tmp_path,
                                                                           check):
    run_dir = tmp_path / "run"
    for key, kind, listed in FIELDS:
        value = _absurd(kind, listed)
        line = _refusal(capsys, [CONFIG, f"{key}={value}", f"run_dir={run_dir}",
                                 *(["--check"] if check else [])])
        assert f"'{key}: " in line and "is out of range for" in line, (key, line)
    assert not run_dir.exists()


@pytest.mark.parametrize("override, holder", [
    ("ddp_step_timeout_s=0", "collective timeout"), ("ddp_step_timeout_s=-1", "collective timeout"),
    ("ddp_timeout_s=0", "collective timeout"), ("rand_seed=-1", "seed"),
    ("rand_seed=99999999999999999999", "seed"), ("lr=1e308", "float32"),
])
def test_values_their_consumers_cannot_hold_are_refused_up_front(capsys, override, holder):
    line = _refusal(capsys, [CONFIG, override, "--check"])
    key = override.split("=")[0]
    assert line.startswith(f"error: command line: '{key}: ") and holder in line, line


@pytest.mark.slow
@pytest.mark.parametrize("override", ["lr=1e308", "rand_seed=99999999999999999999",
                                      "ddp_step_timeout_s=0"])
def test_the_entry_point_refuses_them_before_the_run_starts(tmp_path, override):
    run_dir = tmp_path / "run"
    result = run_command([sys.executable, "-m", "rebm.training.train", CONFIG, override,
                          f"run_dir={run_dir}"], timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "is out of range for" in lines[0], result.output[-3000:]
    assert f"'{override.split('=')[0]}: " in lines[0]
    assert not run_dir.exists()


@pytest.mark.parametrize("value, named", [("runs/a\nb", "a newline"), ("runs/a\tb", "a tab"),
                                          ("runs/a\x01b", "U+0001")])
def test_a_control_character_in_run_dir_is_one_line_not_a_space(capsys, tmp_path, value, named):
    """OmegaConf's override parser would make the newline a space (another run directory than
    the one asked for) and fail on the others with YAML's traceback."""
    run_dir = tmp_path / value
    line = _refusal(capsys, [CONFIG, f"run_dir={run_dir}"])
    assert line.startswith("error: command line: the value of 'run_dir' holds ") and named in line
    assert not any(tmp_path.iterdir())


def test_a_control_character_in_a_files_string_is_one_line(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(f'run_dir: "{tmp_path}/a\\nb"\n')  # YAML's escape: a real newline
    line = _refusal(capsys, [str(config), "--check"])
    assert line.startswith(f"error: {config}: the value of 'run_dir' holds a newline"), line
