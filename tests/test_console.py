"""What a researcher sees: the console's evaluation line and closing summary, every rank's error
in its log file, `--help` without torch, and packaging that keeps an installed torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import BIN, REPO, base_env, finish, run_train
from tests.processes import popen

pytestmark = pytest.mark.timeout(300)

CONFIG = "experiments/quickstart/digits.yaml"
SMALL = ["batch_size=32", "attack.max_steps=1", "attack.start_step=1",
         "indist_attack_clf.max_steps=1", "n_imgs_per_evaluation_log=64",
         "image_log.num_samples=10", "image_log.num_steps=1", "robust_eval_steps=1"]


@pytest.mark.slow
def test_evaluation_line_and_closing_summary(tmp_path):
    result = run_train([CONFIG, *SMALL, "max_steps=3"], run_dir=tmp_path / "run").assert_ok()
    # the starting model, then the start of step 2 (after 1 update): the original's schedule
    assert "evaluation at step 0: clean acc " in result.output
    assert "evaluation at step 1: clean acc " in result.output
    assert "| robust acc " in result.output and "(359 test images)" in result.output
    assert "finished at step 3: clean acc " in result.output
    assert f"files in {tmp_path / 'run'}: model_final.pth" in result.output


@pytest.mark.slow
def test_an_error_on_every_rank_is_in_its_log_file(tmp_path):
    """A bug (not a user error) in the step: each rank's traceback ends up in logs/rank<r>.log."""
    script = tmp_path / "broken_train.py"
    script.write_text(textwrap.dedent("""
        import sys
        from rebm.methods.dat import dat

        def broken(self, ctx, batch, index, log_now):
            raise RuntimeError("injected failure in the step")

        dat.DAT.micro_loss = broken
        from rebm.training.train import main
        sys.exit(main())
    """))
    run_dir = tmp_path / "run"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(script), CONFIG,
           *SMALL, "max_steps=2", f"run_dir={run_dir}"]
    env = base_env(1, {"PYTHONPATH": str(REPO)})
    code, out = finish(popen(cmd, env, REPO), 240)
    assert code != 0, out[-3000:]
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "Traceback" in log and "RuntimeError: injected failure in the step" in log, log


@pytest.mark.parametrize("entry", [["-m", "rebm.training.train"], ["-m", "rebm.eval.evaluate"],
                                   [str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py")]])
def test_help_does_not_import_torch(entry):
    probe = textwrap.dedent(f"""
        import runpy, sys
        entry = {entry!r}
        sys.argv = [entry[-1], "--help"]
        try:
            if entry[0] == "-m":
                runpy.run_module(entry[1], run_name="__main__")
            else:
                runpy.run_path(entry[0], run_name="__main__")
        except SystemExit:
            pass
        print(json.dumps("torch" in sys.modules))
    """).replace("import runpy, sys", "import json, runpy, sys")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False, out.stdout + out.stderr


def test_stage1_schedules_match_the_method():
    import runpy

    from rebm.methods.at import SCHEDULES

    script = runpy.run_path(str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py"))
    assert script["SCHEDULES"] == SCHEDULES


def test_pip_install_keeps_the_installed_torch(tmp_path):
    """The package metadata takes torch as a range: installing rebm into an environment that has
    its own torch (here the suite's, the pinned pair) installs no other torch."""
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                             "--no-build-isolation", "--report", str(report), "-e", str(REPO)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    installs = {item["metadata"]["name"].lower()
                for item in json.loads(report.read_text())["install"]}
    assert installs & {"torch", "torchvision"} == set(), installs
