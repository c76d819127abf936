"""A full training state: its layout, reading it, and loading its parts (where states are saved,
how many are kept and which one a run resumes from: rebm.checkpoint.manager).

A state is a dict of Stateful parts, each under its own key (model, optimizer, scheduler, ema,
scaler, method, progress, rng, tracker), plus metadata (format, stage, step, world size, config).
`training_state` saves and `load_parts` loads every part by one loop; nothing else knows a part's
layout. The data position is the step itself, because the samplers seek to any step in O(1)
(rebm/data/indexing.py). States of the earlier flat layout (format 1: every field at the top
level, the method's merged in) are converted when read (`upgrade_state`, by
rebm/compat/state_format.py)."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from rebm.checkpoint.integrity import archive_damage, first_non_finite
from rebm.compat.state_format import FORMAT2, upgrade_format1
from rebm.distributed import Runtime, all_reduce_max
from rebm.errors import UserError

STATE_FORMAT = FORMAT2  # a newer layout adds its upgrade to rebm/compat/state_format.py
METADATA = ("format", "stage", "step", "world_size", "config")
OPTIONAL_PARTS = ("ema",)  # absent from a state: the EMA restarts from the loaded model


class StateError(UserError, RuntimeError):
    """No usable training state, or one could not be written."""


class StateOfAnotherRun(StateError):
    """A state of another stage or architecture: the previous states of the run are no better,
    so there is no falling back to them."""


class StateUnreadable(StateError):
    """A state the run cannot read for a reason that proves no damage (a permission, an I/O
    error of the filesystem): set aside, it would send the run back to an older state and throw
    away this one's progress, so the run stops instead."""


def _cannot_read(path: str, err: OSError) -> StateUnreadable:
    return StateUnreadable(
        f"training state '{path}' cannot be read ({err.strerror or err}); it is kept as it is "
        "(no proof that it is damaged): make it readable and run the same command again")


def _missing(path: str) -> StateUnreadable:
    return StateUnreadable(
        f"training state '{path}' does not exist; check the path (resume_from_state takes a "
        "state file or a run directory)")


def read_state(path: str) -> Dict[str, Any]:
    """Load a state file (CPU, tensors and plain containers only): StateUnreadable when the
    operating system cannot read it, StateError when its content cannot be loaded."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise _missing(path) from None
    except OSError as err:
        raise _cannot_read(path, err) from None
    except Exception as err:  # truncated zip, unpickling error, ...
        raise StateError(
            f"training state '{path}' is unreadable ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    if not isinstance(state, dict) or "step" not in state or "model" not in state:
        raise StateError(f"'{path}' is not a rebm training state (no 'step'/'model' entries)")
    return upgrade_state(state)


class Stateful(Protocol):
    """A part of a training state (torch.distributed.checkpoint.stateful.Stateful's protocol)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def training_state(parts: Mapping[str, Stateful], stage: int, step: int,
                   config: Dict[str, Any], world_size: int) -> Dict[str, Any]:
    """Every part's state_dict under its own key, plus the metadata of the state (`config`: the
    run's config as to_dict gives it)."""
    state: Dict[str, Any] = {"format": STATE_FORMAT, "stage": stage, "step": step,
                             "world_size": world_size, "config": config}
    for name, part in parts.items():
        state[name] = part.state_dict()
    return state


def load_parts(state: Dict[str, Any], parts: Mapping[str, Stateful]) -> None:
    """Load every part from its own key of `state`; a missing part other than the EMA is an
    error naming it. (The caller checked the state's stage: `check_stage`.)"""
    for name, part in parts.items():
        if name in state:
            part.load_state_dict(state[name])
        elif name not in OPTIONAL_PARTS:
            raise StateError(f"'{state.get('_path', 'the training state')}' has no '{name}' part;"
                             " it was written by another kind of run")


def upgrade_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """A state in the current layout: a format-1 state is converted (rebm/compat/state_format.py),
    others are returned as they are."""
    if state.get("format", 1) >= STATE_FORMAT:
        return state
    return upgrade_format1(state)


def check_stage(state: Dict[str, Any], stage: int) -> None:
    """A state of the other training stage is refused (one line)."""
    found = state.get("stage", 2)  # states written before the field existed are DAT's
    if found != stage:
        raise StateOfAnotherRun(
            f"'{state.get('_path', 'the training state')}' is a stage-{found} training state, "
            f"but this is a stage-{stage} run; give each stage its own run_dir")


def check_state_file(path: str) -> None:
    """StateError in one line unless every record of the state file `path` matches its CRC-32
    (rebm.checkpoint.integrity, the check every weights file passes too: torch.load does not
    check them, so a flipped bit in a tensor would load silently); StateUnreadable when the
    file cannot be read at all."""
    try:
        damage = archive_damage(path)
    except FileNotFoundError:  # not a file to make readable: a wrong path
        raise _missing(path) from None
    except OSError as err:
        raise _cannot_read(path, err) from None
    if damage:
        raise StateError(f"training state '{path}' is damaged ({damage})")


def check_finite_weights(path: str, state: Dict[str, Any]) -> None:
    """StateError in one line when the model's or EMA's floating-point tensors of the state
    `state` (read from `path`) hold a NaN/Inf."""
    for part in ("model", "ema"):
        weights = state.get(part)
        found = first_non_finite(weights) if isinstance(weights, Mapping) else None
        if found:
            raise StateError(f"training state '{path}' holds NaN/Inf in its {part} tensor "
                             f"'{found[0]}'")


def check_model_type(state: Dict[str, Any], model_type: str) -> None:
    """StateOfAnotherRun when the state's run trained another `model.model_type` (resume=force
    continues changed settings, never another architecture)."""
    config = state.get("config")
    model = config.get("model") if isinstance(config, Mapping) else None
    found = model.get("model_type") if isinstance(model, Mapping) else None
    if found is not None and found != model_type:
        raise StateOfAnotherRun(
            f"'{state.get('_path', 'the training state')}' holds a {found} model and this run "
            f"builds a {model_type} (model.model_type): a training state continues only its "
            f"own architecture; choose another run_dir, or model.model_type={found}")


def _shape(value: Any) -> Tuple[int, ...]:
    return tuple(value.shape)


def _weights_misfit(part: str, saved: Any, own: Mapping[str, Any]) -> Optional[str]:
    """How the state dict `saved` of the part `part` differs from `own` (the run's), or None."""
    if not isinstance(saved, Mapping):
        return f"its '{part}' part is not a state dict"
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    if missing or unexpected:
        return (f"its {part} lacks {len(missing)} and adds {len(unexpected)} tensors "
                f"(e.g. {(missing or unexpected)[0]!r})")
    for name, value in own.items():
        if torch.is_tensor(value) and (not torch.is_tensor(saved[name])
                                       or _shape(saved[name]) != _shape(value)):
            found = _shape(saved[name]) if torch.is_tensor(saved[name]) else type(saved[name])
            return f"its {part} tensor '{name}' is {found}, the run's {_shape(value)}"
    return None


def _optimizer_misfit(saved: Any, optimizer: torch.optim.Optimizer,
                      names: Dict[int, str]) -> Optional[str]:
    """How the optimizer state `saved` does not fit `optimizer` (groups, parameter counts, the
    shape of each per-parameter tensor such as momentum), or None. `names`: id(parameter) ->
    its name."""
    if not isinstance(saved, Mapping) or "param_groups" not in saved:
        return "its optimizer part is not an optimizer state"
    groups = saved["param_groups"]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g.get("params", ())) for g in groups] != sizes:
        return (f"its optimizer has parameter groups of {[len(g.get('params', ())) for g in groups]}"
                f" parameters, the run's {sizes}")
    per_parameter = saved.get("state", {})
    for group, own in zip(groups, optimizer.param_groups, strict=True):
        for index, param in zip(group["params"], own["params"], strict=True):
            for key, value in per_parameter.get(index, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and _shape(value) != _shape(param):
                    return (f"its optimizer's '{key}' of '{names.get(id(param), index)}' is "
                            f"{_shape(value)}, the parameter's {_shape(param)}")
    return None


def check_fits(state: Dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               ema: Optional[torch.nn.Module]) -> None:
    """StateError in one line naming the first tensor of `state` that does not fit the run's
    parts (shapes only: they may live on the meta device): the model's weights, the EMA's, and
    the optimizer's per-parameter tensors (momentum, moments)."""
    names = {id(p): name for name, p in model.named_parameters()}
    problems: List[Optional[str]] = [_weights_misfit("model", state.get("model"), model.state_dict())]
    if ema is not None and state.get("ema") is not None:
        problems.append(_weights_misfit("ema", state["ema"], ema.state_dict()))
    problems.append(_optimizer_misfit(state.get("optimizer"), optimizer, names))
    problem = next((p for p in problems if p), None)
    if problem:
        raise StateError(f"training state '{state.get('_path', '?')}' does not fit this run: "
                         f"{problem}")


def _weights_digest(modules: Sequence[torch.nn.Module]) -> int:
    """A 56-bit hash of the bytes of every tensor in the modules' state dicts (host copies)."""
    digest = hashlib.sha256()
    for module in modules:
        for name, tensor in module.state_dict().items():
            if torch.is_tensor(tensor):
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                              .numpy().tobytes())
    return int.from_bytes(digest.digest()[:7], "little")


def check_weights_all_ranks(runtime: Runtime, *modules: torch.nn.Module) -> Tuple[bool, bool]:
    """(finite on every rank, bit-identical on every rank) for the modules' parameters and
    buffers: one all-reduce (MAX) of [not finite, hash, -hash], whose maximum and minimum hash
    agree only when every rank holds the same bytes. Every rank must call it."""
    weights = [p.detach() for m in modules for p in m.parameters()]
    finite = not weights or bool(torch.isfinite(torch.nn.utils.get_total_norm(weights)))
    digest = _weights_digest(modules)
    flags = all_reduce_max(runtime, torch.tensor([int(not finite), digest, -digest],
                                                 dtype=torch.int64)).tolist()
    return not flags[0], flags[1] == -flags[2]


class ProcessRNG:
    """The process's torch RNG states as a Stateful part (CUDA: this process's device only, so
    a state resumes on other GPU counts)."""

    def state_dict(self) -> Dict[str, Any]:
        state = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
