"""The run directory: the one owner of its path and of every file name in it.

A run's folder (names unchanged since the first runs, so older run directories resume):

    config.yaml               the run's config, written first (rebm.engine.tracking)
    metrics.jsonl             one record per metrics log and evaluation
    wandb_id                  the wandb run id, for a run that dies before its first state
    checkpoints/state_<9-digit step>.pt   training states, the newest `keep_last_states` kept
    model_final.pth           the evaluated weights at the end
    model_bestacc.pth, model_bestfid.pth  the best evaluated models (DAT)
    logs/rank<r>.log          every rank's log
    samples/                  PNG grids and the samples of evaluations
    compile_cache/<key>.bin   torch.compile's cache (model.compile)
    reliability*.png, counterfactuals/, eval.json   evaluation's files
    .lock, .shared_check      the job holding the directory; rank 0's token for the other ranks

Rank 0 holds an exclusive lock (`.lock`, flock) for the whole run; the kernel releases it when
the process ends, however it ends. A second job on the same run dir stops at start-up with one
line naming the holder, before it writes anything. What is saved into it, and when, is
rebm.checkpoint.manager's (CheckpointManager). Importing this module imports no torch.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
from typing import Any, Dict, List, Optional, Tuple

import yaml

from rebm.checkpoint.folder_lock import FolderLock
from rebm.config import training_diff
from rebm.disk import reason, room_for
from rebm.distributed import Runtime, decide_on_main, setup_logging
from rebm.distributed.collectives import on_every_rank
from rebm.errors import UserError

LOGGER = logging.getLogger("rebm")
STATE_PATTERN = re.compile(r"state_(\d+)\.pt")  # a state file's name (fullmatch)
_HASHED = re.compile(r"^(?P<name>.+)-[0-9a-f]{8}$")


class RunDirError(UserError, OSError):
    """The run directory cannot be created, or another job holds it."""


class RunDirectory:
    """A run's folder: its path and the path of every file a run (or an evaluation of it)
    writes there. Builds paths only; it creates nothing but what `remove_stale_temp_files` and
    the lock touch."""

    CONFIG = "config.yaml"  # every training run writes it first
    METRICS = "metrics.jsonl"
    WANDB_ID = "wandb_id"
    CHECKPOINTS = "checkpoints"
    FINAL_MODEL = "model_final.pth"
    BEST_ACC_MODEL = "model_bestacc.pth"
    BEST_FID_MODEL = "model_bestfid.pth"
    LOGS = "logs"
    SAMPLES = "samples"
    COMPILE_CACHE = "compile_cache"
    COUNTERFACTUALS = "counterfactuals"
    EVAL_RESULTS = "eval.json"
    LOCK = ".lock"
    SHARED_CHECK = ".shared_check"  # rank 0's token: the other ranks must read it back

    # What a finished run's folder may hold, in the order the closing line lists them; a file
    # is listed only when the run wrote it (stage 1 draws no samples, only DAT keeps best models).
    FILES_FOR_PEOPLE = (
        (FINAL_MODEL, "evaluated weights"),
        (BEST_ACC_MODEL, "best evaluated accuracy"),
        (BEST_FID_MODEL, "best FID"),
        (METRICS, ""),
        (SAMPLES + "/", ""),
        (CHECKPOINTS + "/", "training states; the same command continues the run"),
        (LOGS + "/", ""),
        ("wandb/", ""),
    )

    def __init__(self, path: str):
        self.path = path

    def __repr__(self) -> str:
        return f"RunDirectory({self.path!r})"

    def file(self, name: str) -> str:
        """<run_dir>/<name>."""
        return os.path.join(self.path, name)

    @property
    def config_file(self) -> str:
        return self.file(self.CONFIG)

    @property
    def metrics_file(self) -> str:
        return self.file(self.METRICS)

    @property
    def wandb_id_file(self) -> str:
        return self.file(self.WANDB_ID)

    @property
    def final_model(self) -> str:
        return self.file(self.FINAL_MODEL)

    @property
    def lock_file(self) -> str:
        return self.file(self.LOCK)

    @property
    def shared_check_file(self) -> str:
        return self.file(self.SHARED_CHECK)

    @property
    def states_dir(self) -> str:
        """The folder of the training states."""
        return self.file(self.CHECKPOINTS)

    def state_file(self, step: int) -> str:
        return os.path.join(self.states_dir, f"state_{step:09d}.pt")

    def states(self) -> List[str]:
        """Saved states of the run, newest first. The folder is listed and its names matched:
        a pattern built from the path would read `[`, `*`, `?` in a run_dir's name as wildcards
        and find another run's states."""
        paths = [os.path.join(self.states_dir, name) for name in _names(self.states_dir)
                 if STATE_PATTERN.fullmatch(name)]
        return sorted(paths, key=state_step, reverse=True)

    SET_ASIDE = ".unusable"  # the suffix of a state found damaged (CheckpointManager)

    def set_aside_states(self) -> List[str]:
        """States set aside as damaged (`state_<step>.pt.unusable`), newest first."""
        suffix = self.SET_ASIDE
        paths = [os.path.join(self.states_dir, name) for name in _names(self.states_dir)
                 if name.endswith(suffix) and STATE_PATTERN.fullmatch(name[:-len(suffix)])]
        return sorted(paths, key=lambda path: state_step(path[:-len(suffix)]), reverse=True)

    @property
    def logs(self) -> str:
        return self.file(self.LOGS)

    def log_file(self, rank: int) -> str:
        return os.path.join(self.logs, f"rank{rank}.log")

    def samples(self, name: str) -> str:
        """<run_dir>/samples/<name>."""
        return os.path.join(self.file(self.SAMPLES), name)

    def sample_grid(self, step: Optional[int] = None, kind: str = "gen") -> str:
        """samples/<kind>_samples.png, <kind>_samples_step<8-digit step>.png in training: the
        original's gen_samples_/seed_samples_ names without the hash of its sample folder (one
        run's samples/ holds no other run's grids), with the step so that no evaluation of a
        run overwrites another's."""
        name = f"{kind}_samples" if step is None else f"{kind}_samples_step{step:08d}"
        return self.samples(name + ".png")

    def samples_folder(self, step: Optional[int]) -> str:
        """samples/step_<8-digit step>, or samples/eval without a step (keep_samples)."""
        return self.samples("eval" if step is None else f"step_{step:08d}")

    def samples_npz(self, step: Optional[int]) -> str:
        """samples/samples.npz, samples_step<8-digit step>.npz in training."""
        return self.samples("samples.npz" if step is None else f"samples_step{step:08d}.npz")

    def reliability_diagram(self, step: Optional[int]) -> str:
        """reliability.png, reliability_step<8-digit step>.png in training."""
        return self.file("reliability.png" if step is None else
                         f"reliability_step{step:08d}.png")

    @property
    def counterfactuals(self) -> str:
        return self.file(self.COUNTERFACTUALS)

    @property
    def eval_results(self) -> str:
        """eval.json of `python -m rebm.eval`."""
        return self.file(self.EVAL_RESULTS)

    def compile_cache(self, key: str) -> str:
        return os.path.join(self.file(self.COMPILE_CACHE), f"{key}.bin")

    def describe_files(self) -> str:
        """The run's files for people, as they are in the run directory now, e.g.
        'model_final.pth (evaluated weights), metrics.jsonl, logs/'."""
        found = [f"{name} ({meaning})" if meaning else name
                 for name, meaning in self.FILES_FOR_PEOPLE if os.path.exists(self.file(name))]
        return ", ".join(found) or "none yet"

    def saved_config(self) -> dict:
        """The run's config.yaml as a dict ({} when missing or unreadable)."""
        try:
            with open(self.config_file) as fh:
                return yaml.safe_load(fh) or {}
        except (OSError, yaml.YAMLError):
            return {}

    def remove_stale_temp_files(self) -> None:
        """Temp files of writes a killed job never finished in the run directory and its
        checkpoints/ (listed, never globbed: see `states`): those of the training writers
        (`atomic_torch_save`, the metrics rewrite), which only the lock holder (the caller) runs,
        and those of `process_temp_name` whose process is gone (an evaluation of this run
        may be writing beside it)."""
        for folder in (self.path, self.states_dir):
            _remove_stale(folder, _names(folder), training_writers=True)

    def remove_stale_evaluation_temp_files(self) -> None:
        """Temp files named by a process (`process_temp_name`: evaluation's writers, config.yaml)
        that is no longer alive on this host, anywhere in the folder but the training's own
        subfolders: the caller holds the folder's evaluation lock, so no other evaluation writes
        here; a training run may, under its own live process's name."""
        skipped = {self.CHECKPOINTS, self.LOGS, self.COMPILE_CACHE, "wandb"}
        for root, dirs, names in os.walk(self.path):
            if root == self.path:
                dirs[:] = [d for d in dirs if d not in skipped]
            _remove_stale(root, names, training_writers=False)

    def check_shared(self, token: str, runtime: Runtime) -> None:
        """Every rank must see the file rank 0 just wrote: run_dir has to be on a filesystem
        all nodes share (states, model files and the resume decision live there)."""
        try:
            with open(self.shared_check_file) as fh:
                seen = fh.read().strip()
        except OSError:
            seen = None
        if seen != token:
            raise RunDirError(
                f"run_dir '{self.path}' as seen from rank {runtime.rank} on "
                f"{socket.gethostname()} is not the directory rank 0 created: put run_dir on a "
                "filesystem shared by all nodes")

    @property
    def eval_lock_file(self) -> str:
        """.eval.lock: the evaluation writing into this folder (rebm/eval/files.py)."""
        return self.file(".eval.lock")


# A temp file named by its writing process and host (`process_temp_name`); without the host:
# written before temp names held it.
_PROCESS_TEMP = re.compile(r"\..+\.(?P<pid>\d+)(?:@(?P<host>[^/]+))?\.tmp")


def process_temp_name(path: str) -> str:
    """The temp file a process writes `path` through: hidden, beside it, named by the process
    and its host, so that a later job can tell whether its writer is still alive."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}@{socket.gethostname()}.tmp")


def _writer_gone(name: str, training_writers: bool) -> bool:
    """Whether the temp file `name` is left by a writer that is gone: a process-named one whose
    process is not alive on this host (another host's: unknown, kept), else (the training
    writers' names) `training_writers`."""
    named = _PROCESS_TEMP.fullmatch(name)
    if named is None:
        return training_writers
    if named.group("host") not in (None, socket.gethostname()):
        return False
    pid = int(named.group("pid"))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by another user
        return False
    return False


def _remove_stale(folder: str, names: List[str], training_writers: bool) -> None:
    for name in names:
        path = os.path.join(folder, name)
        if not name.endswith(".tmp") or not _writer_gone(name, training_writers) \
                or not os.path.isfile(path):
            continue
        try:
            os.remove(path)
            LOGGER.info("removed %s, left by an interrupted write", path)
        except OSError:
            pass


def state_step(path: str) -> int:
    """The step of a state file, from its name."""
    return int(STATE_PATTERN.fullmatch(os.path.basename(path)).group(1))


def _names(folder: str) -> List[str]:
    """The names in `folder` ([] when it does not exist or cannot be listed)."""
    try:
        return os.listdir(folder)
    except OSError:
        return []


def config_run_name(run_dir: str) -> str:
    """The run directory's name without its `-<hash>` of training overrides."""
    name = os.path.basename(os.path.normpath(run_dir))
    hashed = _HASHED.match(name)
    return hashed.group("name") if hashed else name


def sibling_runs(run_dir: str) -> List[str]:
    """The other runs of the same config beside `run_dir` (`<name>` and `<name>-<hash>` folders
    holding a config.yaml), sorted, spelled like `run_dir`."""
    parent = os.path.dirname(os.path.normpath(run_dir))
    name = config_run_name(run_dir)
    candidates = [os.path.join(parent, name)]
    candidates += [os.path.join(parent, other) for other in _names(parent or ".")
                   if other.startswith(name + "-")]
    same = os.path.abspath(run_dir)
    return sorted(path for path in candidates
                  if (path == os.path.join(parent, name) or _HASHED.match(os.path.basename(path)))
                  and os.path.abspath(path) != same
                  and os.path.isfile(RunDirectory(path).config_file))


class RunDirLock(FolderLock):
    """An exclusive flock on <run_dir>/.lock; the file says who holds it (FolderLock)."""

    FAILURE = RunDirError

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        super().__init__(RunDirectory(run_dir).lock_file)

    def where(self) -> str:
        return f"run_dir {self.run_dir}"

    def unguarded(self) -> str:
        return "a second job on the same run_dir"  # e.g. Lustre mounted without flock

    def busy(self, holder: str) -> str:
        return (f"run_dir '{self.run_dir}' is in use by {holder}; wait for that job to end, or "
                "choose another run_dir=PATH")

    def if_unwritable(self) -> str:
        return "choose a writable run_dir=PATH"

    def if_holder_unwritten(self) -> str:
        return "free disk space, or choose a run_dir on another filesystem"


def new_run_notice(run_dir: str, config: Dict[str, Any]) -> Optional[str]:
    """For a new run directory `run_dir` beside runs of the same config (`<name>` and
    `<name>-<hash>`: the command line changed training keys, so the default run_dir changed):
    one line naming the nearest of them and the keys that differ from `config` (the run's, as
    to_dict gives it). None when there is none."""
    siblings = sibling_runs(run_dir)
    if not siblings:
        return None
    current = config
    diffs = {path: training_diff(RunDirectory(path).saved_config(), current) for path in siblings}
    nearest = min(siblings, key=lambda path: len(diffs[path]))
    others = f" (and {len(siblings) - 1} other run(s) of this config)" if len(siblings) > 1 else ""
    if diffs[nearest]:
        return (f"new run in {run_dir}: the existing run {nearest}{others} differs in "
                f"{'; '.join(diffs[nearest])} (run_dir={nearest} resume=force would continue "
                "that one instead)")
    return (f"new run in {run_dir}: the existing run {nearest}{others} has the same "
            f"training keys (run_dir={nearest} continues that one instead)")


def create_run_dir(path: str) -> None:
    """Create the run directory `path` (absolute), or RunDirError in one line: a file (or a
    file on its way) in the place of a folder is named as such."""
    blocking = path
    while blocking != os.path.dirname(blocking) and not os.path.lexists(blocking):
        blocking = os.path.dirname(blocking)
    if os.path.islink(blocking) and not os.path.exists(blocking):
        what = f"a symbolic link to '{os.readlink(blocking)}', which does not exist"
        where = f"is {what}" if blocking == path else f"cannot be created: '{blocking}' is {what}"
        raise RunDirError(f"run_dir '{path}' {where}; create its target, or choose another "
                          "run_dir=PATH") from None
    if os.path.lexists(blocking) and not os.path.isdir(blocking):
        where = "is a file" if blocking == path else f"cannot be created: '{blocking}' is a file"
        raise RunDirError(f"run_dir '{path}' {where}, not a directory; choose another "
                          "run_dir=PATH") from None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create run_dir '{path}' ({err.strerror}); choose a "
                          "writable run_dir=PATH") from None


def resolve_run_dir_all_ranks(run_dir: Optional[str], config: Dict[str, Any], runtime: Runtime
                              ) -> Tuple[RunDirectory, Optional[RunDirLock]]:
    """Rank 0 creates and locks the run directory `run_dir` (the config's key: runs/run when
    unset), every rank gets its absolute path and checks that it sees the same directory;
    returns that directory and the lock (rank 0) or None. `config` (the run's, as to_dict gives
    it) is compared with the runs of the same config beside a new one. Every rank calls this."""
    held = []
    setup_logging(runtime)  # the console, for the lines below (the run's log file comes next)

    def choose() -> Tuple[str, str]:
        chosen = os.path.abspath(run_dir or os.path.join("runs", "run"))
        run_directory = RunDirectory(chosen)
        notice = None if os.path.exists(run_directory.config_file) else (
            run_dir and new_run_notice(run_dir, config))
        if notice:
            LOGGER.info("%s", notice)
        create_run_dir(chosen)
        held.append(RunDirLock(chosen))
        run_directory.remove_stale_temp_files()
        token = secrets.token_hex(8)
        try:
            with open(run_directory.shared_check_file, "w") as fh:
                fh.write(token + "\n")
        except OSError as err:
            held.pop().release()
            raise RunDirError(f"cannot write '{run_directory.shared_check_file}' ({reason(err)}; "
                              f"{room_for(run_directory.shared_check_file)}); free disk space, or "
                              "choose a run_dir on another filesystem") from None
        return chosen, token

    chosen, token = decide_on_main(runtime, choose, "create the run directory")
    on_every_rank(runtime, lambda: RunDirectory(chosen).check_shared(token, runtime),
                  "see the run directory")
    return RunDirectory(chosen), (held[0] if held else None)
