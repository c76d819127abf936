"""Real processes for the entry points, without paying for a new interpreter each time.

Every test that runs an entry point (`python -m rebm...`, a script, `torchrun`) runs it in a real,
separate process with its own pid, session, environment, working directory and exit code. A new
interpreter costs about 5 CPU-seconds on the 2-core machine the suite is sized for (torch,
torchvision, and torch._dynamo, which torchvision imports) against a fraction of a second for a
short run, and the suite starts some 200 of them. So the processes are forked from a server that
imported those libraries once (multiprocessing's forkserver: one per pytest process, which has
not run anything), and each one runs its module or script as `__main__` the way `python -m` /
`python FILE` does (runpy), then exits the way the interpreter does: non-daemon threads joined,
atexit handlers run, SystemExit's code, a traceback and exit 1 for an uncaught error. torchrun's
agent starts its workers as new interpreters, as it always does.

What a forked process skips is only the interpreter's own start and final teardown (objects still
alive at exit are not finalised). tests/test_processes.py checks that a run started here and one
started as `python -m` write the same states and print the same lines."""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Dict, Optional, Sequence

# What every entry point imports (the heavy part of a start); not the entry modules themselves,
# which run as __main__ and so must not be imported before.
PRELOAD = ["torch", "torchvision", "timm", "numpy", "PIL.Image", "omegaconf", "scipy.linalg",
           "sklearn.metrics", "torch.distributed.elastic.agent.server.api",
           "rebm.engine.trainer", "rebm.methods.dat", "rebm.methods.at", "rebm.eval.registry",
           "rebm.distributed", "matplotlib.figure", "matplotlib.backends.backend_agg"]

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _target(cmd: Sequence[str]) -> Optional[tuple]:
    """("module", name, argv) or ("path", file, argv) for a command this module can run forked:
    `python -m M ...`, `python FILE ...`, `torchrun ...`; None for anything else."""
    cmd = [str(part) for part in cmd]
    if cmd[0] == str(TORCHRUN):
        return ("module", "torch.distributed.run", cmd)
    if cmd[0] != sys.executable or len(cmd) < 2:
        return None
    if cmd[1] == "-m" and len(cmd) > 2:
        return ("module", cmd[2], [cmd[2], *cmd[3:]])
    if not cmd[1].startswith("-"):
        return ("path", cmd[1], cmd[1:])
    return None


def _exit_code(err: SystemExit) -> int:
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


def _print_traceback() -> None:
    """The uncaught error's traceback from the entry's own frames on (as `python FILE` prints
    it; runpy's and this module's frames left out)."""
    kind, value, tb = sys.exc_info()
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(kind, value, tb)


def _run(target: tuple, env: Dict[str, str], cwd: str, outputs: tuple,
         sigint_ignored: bool) -> None:
    """The child: become `python -m M` (or `python FILE`) in `cwd` with `env`, printing to the
    files `outputs` (stdout, stderr: the same file or two), and exit as the interpreter would.
    Ctrl-C: a new interpreter inherits an ignored SIGINT from the process that starts it, else
    raises KeyboardInterrupt on it; so does this child (the server's own setting is not the
    starter's)."""
    kind, name, argv = target
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.default_int_handler)
    for std, output in zip((1, 2), outputs, strict=True):
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, std)
        os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                  line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  line_buffering=True, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = list(argv)
    sys.path[0] = cwd if kind == "module" else os.path.dirname(os.path.abspath(name))
    code = 0
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
    except SystemExit as err:
        code = _exit_code(err)
    except KeyboardInterrupt:  # the interpreter dies of the SIGINT it did not handle
        _print_traceback()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        _print_traceback()
        code = 1
    threading._shutdown()  # as at interpreter exit: join non-daemon threads, then atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _temporary_file() -> str:
    handle, path = tempfile.mkstemp(prefix="rebm-test-", suffix=".log")
    os.close(handle)
    return path


class ForkedProcess:
    """The part of subprocess.Popen the tests use (pid, poll, wait, communicate, send_signal,
    kill, returncode, args), for a process forked from the preloaded server. Its output goes to
    a file (`output`, or a temporary one that communicate() reads); with `split_stderr`,
    stderr goes to its own temporary file, and communicate() returns both."""

    def __init__(self, cmd: Sequence[str], target: tuple, env: Dict[str, str], cwd: str,
                 output: Optional[str] = None, split_stderr: bool = False):
        self.args = [str(part) for part in cmd]
        self._temporary = [] if output else [_temporary_file()]
        output = output or self._temporary[0]
        if split_stderr:
            self._temporary.append(_temporary_file())
        self._outputs = (output, self._temporary[-1] if split_stderr else output)
        self._texts: Optional[tuple] = None
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        self._process = _CONTEXT.Process(target=_run,
                                         args=(target, env, cwd, self._outputs, ignored))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def communicate(self, timeout: Optional[float] = None) -> tuple:
        self.wait(timeout)
        if self._texts is None:
            out, err = (Path(path).read_text(errors="replace") for path in self._outputs)
            self._texts = (out, err if self._outputs[1] != self._outputs[0] else None)
            for path in self._temporary:
                os.unlink(path)
        return self._texts

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(cmd: Sequence[str], env: Dict[str, str], cwd, output: Optional[str] = None,
          split_stderr: bool = False):
    """Start `cmd` in its own session: forked from the preloaded server when it is an entry
    point (`python -m`, `python FILE`, torchrun), else as a plain subprocess. Its output (stdout
    and stderr together, or apart with `split_stderr`) comes back from communicate(), or goes
    to the file `output`."""
    target = _target(cmd)
    if target is not None:
        return ForkedProcess(cmd, target, dict(env), str(cwd), output, split_stderr)
    stdout = open(output, "a") if output else subprocess.PIPE
    stderr = subprocess.PIPE if split_stderr else subprocess.STDOUT
    try:
        return subprocess.Popen(list(map(str, cmd)), cwd=cwd, env=env, stdout=stdout,
                                stderr=stderr, text=True, start_new_session=True)
    finally:
        if output:
            stdout.close()  # the child has its own copy


LAUNCH_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")


def _in_environment(env: Dict[str, str], fn, *args) -> None:
    """A spawned rank: the spawning test's environment (the server's is the one it started
    with), plus the rank variables the launcher set."""
    launch = {key: os.environ[key] for key in LAUNCH_KEYS if key in os.environ}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(launch)
    fn(*args)


def spawn_ranks(fn, nprocs: int, *args) -> None:
    """rebm.distributed.spawn (the `--nproc` launcher) with its ranks forked from the preloaded
    server instead of started as new interpreters, in this process's current environment."""
    from rebm.distributed import spawn

    spawn(_in_environment, nprocs, dict(os.environ), fn, *args, start_method="forkserver")
