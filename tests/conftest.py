"""What the whole suite shares: runs several test files use, made once per session (each costs
tens of seconds of the 2-core machine the suite is sized for), the `slow` tier, and the order
in which the files start.

`straight`: uninterrupted 20-step DAT runs of tests.helpers' CONFIG + FAST on one process
(`ws1`) and on two with torchrun (`ws2`), a state saved at every step. The DDP-equivalence tests
compare their states; the resume, preemption and failure tests compare a stopped-and-continued
run's state at any step up to 20 with theirs (DAT's learning rate is constant, so the state at
step k does not depend on max_steps).

`slow` (left out by `make test-fast`): tests that start training runs or several processes, or
compute for several seconds. Some files mark their own; SLOW_TESTS and SLOW_FILES name the rest."""

from __future__ import annotations

import gc
import os

import pytest
from filelock import FileLock

from tests.helpers import CONFIG, FAST, STRAIGHT_STEPS, run_train

SLOW_TESTS = {  # file: tests (without parameters) that start processes or compute for seconds
    "tests/test_eval.py": {"test_accuracy_identical_on_1_2_3_ranks",
                           "test_samples_identical_on_1_2_3_ranks",
                           "test_evaluate_entry_point_prints_json"},
    "tests/test_fid.py": {"test_fid_stats_on_2_ranks_equal_one_process_and_load_in_pytorch_fid",
                          "test_fid_with_sweep_identical_on_1_and_2_ranks"},
    "tests/test_step.py": {"test_attacks_bypass_ddp_and_ranks_stay_identical"},
    "tests/test_checkpoint_io.py": {"test_round_trip_ddp_two_processes"},
    "tests/test_eval_metrics.py": {"test_every_metric_and_file_identical_on_1_2_3_ranks",
                                   "test_is_and_pr_equal_torch_fidelity_on_the_sample_pngs",
                                   "test_is_and_pr_with_torch_fidelitys_inception_from_a_local_file",
                                   "test_unknown_metric_is_a_one_line_error",
                                   "test_console_table_and_eval_json_name_every_setting"},
    "tests/test_table.py": {"test_table_on_2_processes_equals_a_killed_and_rerun_single_process",
                            "test_a_moved_checkpoint_folder_keeps_the_cache_and_a_changed_checkpoint_does_not",
                            "test_unknown_metric_and_bad_override_name_the_row"},
    "tests/test_counterfactuals.py": {
        "test_class_statistics_are_those_of_the_class_images",
        "test_counterfactuals_identical_on_1_and_2_processes_with_grids_and_class_fid"},
    "tests/test_state_format.py": {"test_a_format1_dat_state_resumes_bit_identically",
                                   "test_a_format1_stage1_state_resumes_bit_identically"},
    "tests/test_method_streams.py": {"test_check_plans_memory_for_the_methods_streams",
                                     "test_a_bad_loss_weight_is_one_line_under_check"},
    "tests/test_ood.py": {"test_ood_table_identical_on_1_and_2_processes"},
    "tests/test_models_imagenet.py": {"test_matches_timm_forward_for_the_same_weights"},
    "tests/test_speed_defaults.py": {"test_dat_run_compiles_two_graphs_whatever_t"},
    "tests/test_speed_options.py": {"test_dat_step_runs_under_each_precision"},
    "tests/test_run_dir.py": {
        "test_default_run_dir_is_the_config_name_and_survives_length_overrides"},
    "tests/test_config.py": {"test_check_via_subprocess_prints_yaml"},
}
SLOW_FILES = {"tests/test_console_messages.py", "tests/test_faults.py"}  # every test starts runs


# The files that take longest (CPU-seconds, or seconds of waiting), longest first. pytest-xdist
# (`--dist loadfile --no-loadscope-reorder`, as the Makefile runs it) hands out files in
# collection order, so starting these first keeps both workers busy to the end instead of one
# waiting while the other runs a long file last.
LONGEST_FIRST = ["tests/test_resume.py", "tests/test_stage1.py", "tests/test_interrupts.py",
                 "tests/test_imagenet_training.py", "tests/test_faults.py", "tests/test_table.py",
                 "tests/test_console_messages.py", "tests/test_shipped_configs.py",
                 "tests/test_run_dir.py", "tests/test_eval_metrics.py",
                 "tests/test_speed_defaults.py"]


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        path, _, name = item.nodeid.partition("::")
        if path in SLOW_FILES or name.split("[")[0] in SLOW_TESTS.get(path, ()):
            item.add_marker(pytest.mark.slow)
    rank = {path: number for number, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


def pytest_collection_finish(session):
    """The test modules have imported torch, torchvision, timm...: about a million objects that
    every full garbage collection would walk again; freeze them (as the entry points do)."""
    gc.freeze()


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """The folder holding the reference runs `ws1` (one process) and `ws2` (two processes).
    Under pytest-xdist (`make test`) the workers share one copy: the first to need it makes it
    while holding a lock in the session's common temporary folder, the others wait and read."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "straight"
    with FileLock(str(shared / "straight.lock")):
        if not (root / "done").exists():
            for nproc in (1, 2):
                run_train([CONFIG, *FAST, f"max_steps={STRAIGHT_STEPS}"], nproc=nproc,
                          run_dir=root / f"ws{nproc}", timeout=400).assert_ok()
            (root / "done").touch()
    return root
