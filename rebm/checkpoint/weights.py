"""Universal model-checkpoint loading and atomic saving.

`load_checkpoint` accepts every layout this project and the original code write (docs/design.md §5):
  - a plain state dict;
  - wrapper prefixes, nested in any order: `module.` (DataParallel / DDP / AveragedModel),
    `_orig_mod.` (torch.compile), `base_model.`, `ema_model.` (ema-pytorch);
  - the metadata entries of averaging wrappers (`n_averaged`, ema-pytorch `initted`, `step`),
    e.g. the original EMA layout `module.n_averaged` + `module.module.*`;
  - ema-pytorch state dicts: the `ema_model.` weights are loaded, `online_model.` is dropped;
  - containers: `state_dict`, `model_state_dict`, `model`, `ema_state_dict`, `ema`,
    `state_dict_ema` (a full training state and timm's training checkpoints are such containers);
  - timm's plain state dicts (rebm's ImageNet models use timm's parameter names);
  - public robust ImageNet files that keep a normaliser beside the network (layouts.py): the
    `robustness` library's and Singh et al.'s / RobustBench's `normalize` + `model` Sequential;
    their normaliser is checked against the model's `normalize_input` and statistics.

Container choice: the model weights by default; `prefer_ema=True` takes `ema_state_dict`/`ema`
first. A container with only EMA weights loads them either way.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import secrets
import zipfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
import torch.nn as nn

from rebm.checkpoint.integrity import archive_damage, first_non_finite
from rebm.checkpoint.layouts import check_normaliser, split_normaliser
from rebm.disk import WriteError
from rebm.distributed.parallel import unwrap
from rebm.errors import UserError

LOGGER = logging.getLogger("rebm")

WRAPPER_PREFIXES = ("module", "_orig_mod", "base_model", "ema_model")
METADATA_KEYS = ("n_averaged", "initted", "step")
MODEL_ENTRIES = ("state_dict", "model_state_dict", "model")
EMA_ENTRIES = ("ema_state_dict", "ema", "state_dict_ema")
_SHOW = 4  # example key names per category in a mismatch report


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be read or does not fit the model; the message is short and names
    the path."""


@dataclass
class LoadReport:
    path: str
    layout: str  # how the weights were found, e.g. "['model_state_dict'] > module."
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    mismatched: List[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def _unreadable(path: str, err: BaseException) -> CheckpointError:
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(2)
    if size == 0:
        what = "the file is empty"
    elif head == b"PK" and not zipfile.is_zipfile(path):
        what = "the file is truncated (incomplete zip archive)"
    elif head == b"PK" or head[:1] == b"\x80":
        what = "the file is corrupted"
    else:
        what = "this is not a torch.save file"
    reason = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:100]
    return CheckpointError(
        f"cannot load checkpoint '{path}': {what} ({size} bytes; {type(err).__name__}: {reason})"
    )


def _safe_globals() -> List[Any]:
    """The Python objects, besides tensors and plain containers, that real checkpoints of the
    original code and of public robust models hold and that can be rebuilt without running
    code: argparse namespaces (saved run arguments), numpy scalars, dtypes and arrays (saved
    metrics)."""
    import argparse
    import codecs

    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core
    dtype_classes = [type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32,
                                                 np.bool_)]
    return [argparse.Namespace, codecs.encode, np.dtype, np.ndarray, multiarray.multiarray.scalar,
            multiarray.multiarray._reconstruct, *dtype_classes]


TRUST_KEY = "model.trust_checkpoint"


def read_checkpoint(path: str, trust: bool = False) -> Any:
    """torch.load to CPU with weights_only=True and rebm's allow-list (`_safe_globals`): a file
    is never unpickled into arbitrary objects, whose loading can run code. A well-formed file
    that holds other objects is refused in one line naming it and the object, unless `trust`
    (the config's model.trust_checkpoint): then it is read with weights_only=False."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint '{path}' is a directory, not a file")
    check_intact(path)
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # Only a well-formed file refused for its Python objects may fall back; a corrupt file
        # must not be handed to the full unpickler.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if not found:
            raise _unreadable(path, err) from None
        if not trust:
            raise CheckpointError(
                f"checkpoint '{path}' holds a Python object rebm does not load by default "
                f"({found.group(1)}; loading it can run code); if you trust this file, set "
                f"{TRUST_KEY}=true") from None
        LOGGER.warning("checkpoint '%s' holds Python objects (%s); loading it with "
                       "weights_only=False because %s=true", path, found.group(1), TRUST_KEY)
    except Exception as err:  # truncated zip, text file, empty file, ...
        raise _unreadable(path, err) from None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise _unreadable(path, err) from None


def check_intact(path: str) -> None:
    """CheckpointError in one line unless every record of the weights file `path` matches its
    CRC-32 (rebm.checkpoint.integrity: the check training states pass too), or when the file
    cannot be read at all."""
    try:
        damage = archive_damage(path)
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint '{path}' ({err.strerror or err}); check "
                              "that this process may read it") from None
    if damage:
        raise CheckpointError(f"checkpoint '{path}' is damaged: {damage}; its numbers cannot be "
                              "trusted: restore the file from a copy, or take an earlier "
                              "checkpoint of that run")


# --------------------------------------------------------------------------------------------
# Finding the weights
# --------------------------------------------------------------------------------------------
def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def _select_weights(obj: Any, prefer_ema: bool, path: str, trail: List[str]) -> Dict[str, Any]:
    """Descend through containers to a flat {name: tensor} dict."""
    if isinstance(obj, nn.Module):  # a pickled module (weights_only=False files)
        trail.append(f"{type(obj).__name__}.state_dict()")
        return dict(obj.state_dict())
    if _is_state_dict(obj):
        return dict(obj)
    if isinstance(obj, Mapping):
        order = EMA_ENTRIES + MODEL_ENTRIES if prefer_ema else MODEL_ENTRIES + EMA_ENTRIES
        for key in order:
            if isinstance(obj.get(key), (Mapping, nn.Module)):
                trail.append(f"['{key}']")
                return _select_weights(obj[key], prefer_ema, path, trail)
        keys = ", ".join(map(str, list(obj)[:8])) + (", ..." if len(obj) > 8 else "")
        raise CheckpointError(
            f"checkpoint '{path}' holds a dict without model weights (keys: {keys}); expected a "
            f"state dict or one of the entries {', '.join(MODEL_ENTRIES + EMA_ENTRIES)}"
        )
    raise CheckpointError(f"checkpoint '{path}' holds a {type(obj).__name__}, not model weights")


def _strip_wrappers(sd: Dict[str, Any], target: Set[str], trail: List[str]) -> Dict[str, Any]:
    """Remove wrapper prefixes (and wrapper metadata) until the names stop changing or fit the
    target; works for any nesting order, e.g. module._orig_mod.module.<name>."""
    while set(sd) != target:
        body = {k: v for k, v in sd.items() if k not in METADATA_KEYS}
        if not body or any("." not in k for k in body):
            break
        heads = {k.split(".", 1)[0] for k in body}
        if "ema_model" in heads and heads <= {"ema_model", "online_model"}:
            keep = "ema_model"  # ema-pytorch: the averaged weights, not the online copy
        elif len(heads) == 1 and next(iter(heads)) in WRAPPER_PREFIXES:
            keep = next(iter(heads))
        else:
            break
        sd = {k[len(keep) + 1 :]: v for k, v in body.items() if k.startswith(keep + ".")}
        trail.append(f"{keep}.")
    return sd


def extract_state_dict(
    obj: Any, target_keys: Optional[Set[str]] = None, prefer_ema: bool = False, path: str = "?",
    model: Optional[nn.Module] = None,
) -> Tuple[Dict[str, Any], str]:
    """(plain state dict, description of the layout) from anything `read_checkpoint` returns.
    A file's own normaliser (layouts.py) is checked against `model`'s when a model is given."""
    trail: List[str] = []
    target = target_keys or set()
    sd = _select_weights(obj, prefer_ema, path, trail)
    sd = _strip_wrappers(sd, target, trail)
    unsplit = len(trail)
    sd, normaliser = split_normaliser(sd, target, trail)
    if len(trail) > unsplit:
        sd = _strip_wrappers(sd, target, trail)
    if normaliser is not None and model is not None:
        check_normaliser(model, normaliser, path)
    return sd, " > ".join(trail) or "plain"


def non_finite(sd: Mapping[str, Any]) -> Optional[str]:
    """None when every floating-point tensor of the state dict `sd` is finite, else e.g.
    "NaN/Inf in tensor 'fc.weight' (3 of 640 values)" for the first that is not."""
    found = first_non_finite(sd)
    if found is None:
        return None
    name, bad, count = found
    return f"NaN/Inf in tensor '{name}' ({bad} of {count} values)"


# --------------------------------------------------------------------------------------------
# Loading into a model
# --------------------------------------------------------------------------------------------
def _examples(items: List[str]) -> str:
    more = f", ... (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
    return ", ".join(items[:_SHOW]) + more


def load_checkpoint(
    model: nn.Module, path: str, strict: bool = True, prefer_ema: bool = False,
    trust: bool = False,
) -> LoadReport:
    """Load the weights in `path` into `model` (wrapped or not; they go into `unwrap(model)`).
    `trust`: see `read_checkpoint`.

    strict=True: any missing / unexpected / shape-mismatched key raises CheckpointError with a
    short diff. strict=False: loads the keys that fit and logs the same diff as a warning.
    """
    path = os.fspath(path)
    target = unwrap(model)
    own = target.state_dict()
    sd, layout = extract_state_dict(read_checkpoint(path, trust), set(own), prefer_ema, path,
                                    model=target)
    bad = non_finite(sd)
    if bad:
        raise CheckpointError(f"checkpoint '{path}' holds {bad}; these weights cannot be "
                              "used: take an earlier checkpoint of that run")

    # num_batches_tracked is absent from very old checkpoints; BatchNorm fills it in itself.
    missing = [k for k in own if k not in sd and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in sd if k not in own]
    bad_shape = [k for k in sd if k in own and sd[k].shape != own[k].shape]
    mismatched = [f"{k} {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}" for k in bad_shape]
    report = LoadReport(path, layout, missing, unexpected, mismatched)
    if missing or unexpected or mismatched:
        lines = [
            f"checkpoint '{path}' does not fit {type(target).__name__} (layout: {layout}): "
            f"{len(missing)} missing, {len(unexpected)} unexpected, "
            f"{len(mismatched)} shape-mismatched keys"
        ]
        for name, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape mismatch", mismatched),
        ):
            if items:
                lines.append(f"  {name} ({len(items)}): {_examples(items)}")
        if strict:
            lines.append("  check model.model_type and data.num_classes against the checkpoint")
            raise CheckpointError("\n".join(lines))
        LOGGER.warning(
            "%s\n  loading the %d matching keys (strict=False)",
            "\n".join(lines),
            len(sd) - len(unexpected) - len(mismatched),
        )
        sd = {k: v for k, v in sd.items() if k in own and k not in bad_shape}
    target.load_state_dict(sd, strict=strict)
    LOGGER.info("loaded checkpoint '%s' (layout: %s)", path, layout)
    return report


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
# torch.save's zip writer reports a failed write (a disk that filled, a file-size limit) as a
# RuntimeError: "unexpected pos N vs M" or "PytorchStreamWriter failed writing file ...".
_TORCH_WRITE_FAILED = re.compile(r"unexpected pos|PytorchStreamWriter failed|file write failed")


def atomic_torch_save(obj: Any, path: str) -> None:
    """torch.save that never leaves a partial file at `path`: write a temp file in the same
    directory (same filesystem, so os.replace is atomic), fsync it, then rename over `path`.
    The file gets the permissions of any file the process creates (0644 under umask 022; a
    mkstemp file would be 0600). A failed write, torch.save's own RuntimeError on a full disk
    ("unexpected pos ...") included, is a WriteError naming the file and the free space; after
    any failure the temp file is removed and whatever `path` held is untouched."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    # named apart from the process-named temp files of evaluation (process_temp_name), whose
    # cleanup asks whether their writer lives: only the run directory's holder removes these
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.save.tmp")
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError) or (isinstance(err, RuntimeError)
                                        and _TORCH_WRITE_FAILED.search(str(err))):
            raise WriteError(path, err) from None
        raise
    try:  # persist the rename itself (best effort: not every filesystem allows it)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def save_model(model: nn.Module, path: str) -> None:
    """Plain, unprefixed state dict of the unwrapped model (loads anywhere with
    `load_state_dict` or `load_checkpoint`)."""
    atomic_torch_save(unwrap(model).state_dict(), path)
