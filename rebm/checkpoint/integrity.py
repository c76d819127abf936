"""Whether a file torch.save wrote is intact: the one check every weights file and training state
rebm reads passes before its numbers are used (rebm.checkpoint.weights.read_checkpoint,
rebm.checkpoint.manager.trusted).

torch.save writes a zip archive holding a CRC-32 of every record, which torch.load does not
check: a flipped bit in tensor data loads silently as another number. `archive_damage` reads
every record and compares. It tells damage (a CRC that does not match, metadata zipfile cannot
parse, whatever it raises) apart from a file that cannot be read at all (a permission, an I/O
error of the disk or the network filesystem): only the first is proof that the file is bad;
the second is raised as the OSError it is. Importing this module imports no torch.
"""

from __future__ import annotations

import io
import zipfile
from typing import Any, Mapping, Optional, Tuple

import torch


class _ReadFailed(Exception):
    """An OSError of the operating system reading the file, carried through zipfile, whose own
    errors on damaged metadata may be OSErrors too (a seek to a negative offset)."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _SourceFile(io.FileIO):
    """The file, read unbuffered, with the operating system's read errors set apart."""

    def read(self, size: int = -1) -> bytes:
        try:
            return super().read(size)
        except OSError as err:
            raise _ReadFailed(err) from None

    def readall(self) -> bytes:
        try:
            return super().readall()
        except OSError as err:
            raise _ReadFailed(err) from None

    def readinto(self, buffer: Any) -> Optional[int]:
        try:
            return super().readinto(buffer)
        except OSError as err:
            raise _ReadFailed(err) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:100]}" if text else type(err).__name__


def archive_damage(path: str) -> Optional[str]:
    """What is damaged in the torch.save file `path`, e.g. "the CRC-32 of its record
    'archive/data/3' does not match its data", or None when every record matches its CRC (or
    the file is no zip archive: torch.save's format before torch 1.6 keeps no CRC, and
    torch.load judges such a file). OSError, as raised, when the file cannot be opened or read:
    that is not damage (module docstring)."""
    with _SourceFile(path, "r") as source:
        try:
            if not zipfile.is_zipfile(source):
                return None
            with zipfile.ZipFile(source) as archive:
                record = archive.testzip()
        except _ReadFailed as failed:
            raise failed.error from None
        except Exception as err:  # BadZipFile, UnicodeDecodeError, zlib.error, EOFError, ...
            return f"its zip metadata is damaged ({_first_line(err)})"
    if record is not None:
        return f"the CRC-32 of its record '{record}' does not match its data"
    return None


def first_non_finite(tensors: Mapping[str, Any]) -> Optional[Tuple[str, int, int]]:
    """(name, values not finite, values) of the first floating-point or complex tensor of
    `tensors` that holds a NaN or Inf; None when there is none."""
    for name, value in tensors.items():
        if torch.is_tensor(value) and (value.is_floating_point() or value.is_complex()):
            finite = torch.isfinite(value)
            if not bool(finite.all()):
                return name, int(finite.numel() - finite.sum()), finite.numel()
    return None
