"""How evaluation writes its results files and owns its output folder.

- `write_replacing(path, write)`: every results file (eval.json, the table's files and cache,
  sample grids, reliability diagrams, sample PNGs) is written to a temporary file of this
  process's own name beside it, then renamed over `path`: a reader sees the previous file or the
  new one, never a part of one. A write that fails (full disk, a file-size limit) removes its
  temporary file, leaves the previous file as it was, and raises OSError naming `path` (its strerror names the
  file too: the one-line messages quote only the strerror).
- `OutputFolderLock`: an evaluation holds an exclusive lock (flock) on `<folder>/.eval.lock` of
  its output folder for as long as it runs (`rebm.eval.evaluate` on its run_dir, a table on its
  --out folder); a second evaluation into the same folder stops at start-up with one line naming
  the holder, before it writes anything. The kernel releases the
  lock when the process ends, however it ends. Having it, the evaluation removes the temporary
  files of writers on this host that are gone (a killed evaluation or table).
"""

from __future__ import annotations

import os
from typing import Callable

from rebm.checkpoint.folder_lock import FolderLock
from rebm.checkpoint.run_directory import RunDirectory, process_temp_name
from rebm.errors import UserError


def temporary_name(path: str) -> str:
    """The temporary file `path` is written to: hidden, beside it, named by this process and
    its host (an evaluation that finds one whose process is gone removes it)."""
    return process_temp_name(path)


def write_replacing(path: str, write: Callable[[str], None]) -> str:
    """`write(temporary path)`, then the temporary file renamed over `path` (module docstring);
    returns `path`. On failure nothing of it is left and the previous `path` is unchanged."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        remove_quietly(tmp)
        raise OSError(err.errno, f"{err.strerror or err}, writing {os.path.basename(path)}",
                      path) from None
    except BaseException:
        remove_quietly(tmp)
        raise
    return path


def write_text_replacing(path: str, text: str) -> str:
    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as fh:
            fh.write(text)

    return write_replacing(path, write)


def remove_quietly(path: str) -> None:
    """Remove `path` if it is there (cleaning up after a failed write: its own error counts)."""
    try:
        os.remove(path)
    except OSError:
        pass


class EvalFolderBusy(UserError, OSError):
    """Another evaluation is writing into the same output folder."""


class OutputFolderLock(FolderLock):
    """An exclusive flock on `<folder>/.eval.lock` (module docstring; FolderLock); the file
    names the holder. Taken by rank 0 only; `release()` at the end, or the process's exit.
    `elsewhere` is how the user names another folder (run_dir=PATH, a table's --out DIR)."""

    FAILURE = EvalFolderBusy

    def __init__(self, folder: str, elsewhere: str = "run_dir=PATH"):
        self.folder, self.elsewhere = folder, elsewhere
        super().__init__(RunDirectory(folder).eval_lock_file)
        # held: no other evaluation writes here, so a temp file of a gone process is stale
        RunDirectory(folder).remove_stale_evaluation_temp_files()

    def where(self) -> str:
        return self.folder

    def unguarded(self) -> str:
        return "a second evaluation into the same folder"

    def busy(self, holder: str) -> str:
        return (f"output folder '{self.folder}' is in use by another evaluation ({holder}); "
                f"wait for it to end, or write elsewhere with {self.elsewhere}")

    def if_unwritable(self) -> str:
        return f"choose a writable output folder with {self.elsewhere}"
