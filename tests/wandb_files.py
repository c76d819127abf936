"""Read what wandb wrote for an offline run: the records of its `run-<id>.wandb` file.

wandb keeps no Python reader for this file any more; its layout is a LevelDB-style log (32 KiB
blocks; each chunk a 7-byte header: crc32 (4), length (2), type (1): 1 full, 2 first, 3 middle,
4 last) after a 7-byte file header, each record a `wandb_internal_pb2.Record`."""

from __future__ import annotations

import glob
import os
import struct
from typing import Dict, Iterator, List

BLOCK = 32768
CHUNK_HEADER = 7


def _chunks(raw: bytes) -> Iterator[bytes]:
    pos, pending = CHUNK_HEADER, b""
    while pos + CHUNK_HEADER <= len(raw):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + CHUNK_HEADER])
        data = raw[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == 1:
            yield data
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            yield pending + data
            pending = b""


def offline_runs(run_dir) -> List[str]:
    """The offline run folders wandb made under <run_dir>/wandb, oldest first."""
    return sorted(glob.glob(os.path.join(str(run_dir), "wandb", "offline-run-*")))


def read_run(folder: str) -> Dict[str, object]:
    """{"id", "name", "history": [set of keys of each history record]}."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(folder, "run-*.wandb"))
    out: Dict[str, object] = {"history": []}
    with open(path, "rb") as fh:
        raw = fh.read()
    for data in _chunks(raw):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(id=record.run.run_id, name=record.run.display_name)
        elif kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key)
                                   for item in record.history.item})
    return out
