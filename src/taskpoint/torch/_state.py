"""``StateDict``: a torch state dict saved by ``torch.save`` straight into a manager step, and loading it back.

``CheckpointManager.save(StateDict(model.state_dict()), step)`` writes the ``torch.save`` file into the step's
folder as it is serialized, in pieces hashed on other threads (:mod:`._state_kind`), instead of serializing into
bytes that are then copied and hashed again (issue 26: 2.2x the time of ``torch.save`` + fsync).
:func:`load_state_dict_sync` hands ``torch.load`` a reader that checks each piece before ``torch.load`` sees it.
A manager's background save stages the tensors in shared memory for its save process, which writes the same step
(:mod:`._staged`); a :class:`~taskpoint.Checkpoint` stores the ``torch.save`` bytes as a raw payload.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, cast, overload

import anyio.to_thread
import fsspec.utils
import torch

from ..errors import CheckpointCorruptError, RestoreMismatch, RestoreReport
from ..format.names import STATE_DICT_KIND as STEP_KIND
from ..manager import CheckpointManager
from ..manager.kind_api import Segment, part_kind
from ..payloads import BytesPayload, Payload, register_payload
from ._match import Apply, Mismatches, module_plan
from ._staged import Plan
from ._state_file import STATE_FILE

if TYPE_CHECKING:
    from ..pieces import PieceReader

#: What a state dict may hold, besides nested dicts, lists and tuples: what ``torch.load(weights_only=True)``
#: loads back.
_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _check_leaves(value: object, path: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"StateDict: the key {key!r} at {path or 'the top'} is a {type(key).__name__}; "
                                "a state dict's keys are str (or int, as an optimizer's state is numbered)")
            _check_leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for number, item in enumerate(value):
            _check_leaves(item, f"{path}[{number}]")
    elif not isinstance(value, _LEAVES):
        raise TypeError(f"StateDict: {path} is a {type(value).__name__}, which torch.load(weights_only=True) "
                        "cannot load back; a state dict holds tensors, numbers, strings and nested dicts, lists "
                        "and tuples of them (model.state_dict(), optimizer.state_dict())")


class StateDict:
    """A torch state dict to save with :meth:`CheckpointManager.save <taskpoint.CheckpointManager.save>`:
    a dict with str keys of tensors, numbers, strings and nested dicts, lists and tuples of them, as
    ``model.state_dict()`` and ``optimizer.state_dict()`` return (or a dict of several). TypeError at once,
    naming the entry, for anything else: it could not be loaded back with ``weights_only=True``."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"StateDict takes a dict of tensors (model.state_dict()), not a {type(state).__name__}")
        for key in state:
            if not isinstance(key, str):
                raise TypeError(f"StateDict: the top-level key {key!r} is a {type(key).__name__}, not a str")
        _check_leaves(state, "")
        self.state = state

    def __repr__(self) -> str:
        return f"StateDict({len(self.state)} entries)"


class SavedAsStateDict:
    """Base of objects a manager saves as the state dict their :meth:`state_dict` returns, taken when the save is
    called (:class:`~taskpoint.torch.TrainState`)."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError


class StateDictPayload(BytesPayload):
    """A :class:`StateDict`. A manager's blocking save writes it through the ``torch.state_dict`` step kind
    (``torch.save`` into the step, :meth:`save_into`), and a background save stages it (:meth:`stage`) for the save
    process to write the same; anything else stores its ``torch.save`` bytes, serialized once, when first needed
    (at the latest when a background save without a save process snapshots it, so that the caller may change its
    tensors as soon as the save call returns)."""

    kind = "torch.state_dict"
    staged_by = "taskpoint.torch._staged"
    staged_kind = STEP_KIND
    result_name = STATE_FILE  # what a load of a Checkpoint object holding one writes, as a step's restore does

    def __init__(self, state: StateDict) -> None:
        self._state: Mapping[str, Any] | None = state.state
        self._bytes: bytes | None = None
        self._plan: Plan | None = None

    def staging_size(self) -> int | None:
        """The bytes a background save stages this state in (:mod:`._staged`), or None when it cannot be staged
        (it is then snapshotted as its ``torch.save`` bytes)."""
        if self._state is None:
            return None
        try:
            self._plan = Plan(self._state)
        except TypeError:
            return None
        return self._plan.size

    def stage(self, segment: Segment) -> Payload:
        """Copy the state into ``segment`` (after :meth:`staging_size`); what the save then writes."""
        assert self._plan is not None
        plan, self._plan = self._plan, None
        return plan.copy_into(segment)

    @property
    def _view(self) -> memoryview:  # type: ignore[override]  # BytesPayload's bytes, serialized on first use
        return memoryview(self.serialized())

    def serialized(self) -> bytes:
        """The ``torch.save`` bytes of the state dict, made on the first call."""
        if self._bytes is None:
            buffer = io.BytesIO()
            torch.save(self._state, buffer)
            self._bytes, self._state = buffer.getvalue(), None
        return self._bytes

    @property
    def is_serialized(self) -> bool:
        return self._bytes is not None

    def save_into(self, sink: IO[bytes]) -> None:
        """``torch.save`` the state dict into ``sink``, a writable file (only before :meth:`serialized`)."""
        if self._state is None:
            raise RuntimeError("the state dict was serialized into bytes already")
        torch.save(self._state, sink)

    @classmethod
    def claim(cls, data: object) -> Payload | None:
        if isinstance(data, SavedAsStateDict):
            return cls(StateDict(data.state_dict()))
        return cls(data) if isinstance(data, StateDict) else None

    def snapshot(self, scratch: Path) -> Payload:
        self.serialized()
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # to the save process: its bytes, a plain payload that needs no torch
        return BytesPayload, (self.serialized(),)


register_payload(StateDictPayload)


@overload
def load_state_dict_sync(manager: CheckpointManager, step: int | None = None, *, fallback: bool = False,
                         map_location: Any = None, mmap: bool = False, into: None = None,
                         broadcast: bool = False) -> dict[str, Any] | None:
    ...


@overload
def load_state_dict_sync(manager: CheckpointManager, step: int | None = None, *, fallback: bool = False,
                         map_location: Any = None, mmap: bool = False, into: torch.nn.Module,
                         strict: Literal[True] = True, broadcast: bool = False) -> int | None:
    ...


@overload
def load_state_dict_sync(manager: CheckpointManager, step: int | None = None, *, fallback: bool = False,
                         map_location: Any = None, mmap: bool = False, into: torch.nn.Module,
                         strict: Literal[False], broadcast: bool = False) -> RestoreReport | None:
    ...


def load_state_dict_sync(manager: CheckpointManager, step: int | None = None, *, fallback: bool = False,
                         map_location: Any = None, mmap: bool = False, into: torch.nn.Module | None = None,
                         strict: bool = True, broadcast: bool = False) -> dict[str, Any] | int | RestoreReport | None:
    """Blocking twin of :func:`load_state_dict`."""
    if into is not None:
        return _load_into(manager, step, into, strict, fallback, map_location, broadcast)
    if not isinstance(mmap, bool):
        raise TypeError(f"mmap is True or False, not {mmap!r}")
    if step is None:
        newest = manager.latest_step()
        if newest is None:
            return None
        tried = sorted(manager.steps(), reverse=True) if fallback else [newest]
    else:
        tried = [step, *sorted((s for s in manager.steps() if s < step), reverse=True)] if fallback else [step]
    first: CheckpointCorruptError | None = None
    for number in tried:
        try:
            return _load_step(manager, number, map_location, mmap, broadcast)
        except CheckpointCorruptError as exc:
            if not fallback:
                raise
            first = first or exc
            warnings.warn(f"step {number} in {manager.directory} could not be loaded ({exc}); trying the next "
                          "older step", stacklevel=2)
    assert first is not None
    raise first


async def load_state_dict(manager: CheckpointManager, step: int | None = None, *, fallback: bool = False,
                          map_location: Any = None, mmap: bool = False, into: torch.nn.Module | None = None,
                          strict: bool = True, broadcast: bool = False) -> dict[str, Any] | int | RestoreReport | None:
    """The state dict saved as ``StateDict(...)`` in ``step`` (the newest when None; None when there is no
    step), loaded by ``torch.load(weights_only=True)`` with ``map_location``.

    ``into=model`` loads it into the module instead and returns the step restored (None when there is none),
    after checking every name, shape and dtype against ``model.state_dict()`` first: a missing, unexpected or
    mismatched entry raises :class:`~taskpoint.errors.RestoreMismatch` naming them, with the model untouched.
    ``strict=False`` loads what matches and returns a :class:`~taskpoint.errors.RestoreReport` of the rest.

    Every byte ``torch.load`` reads was checked against the digest of its piece first: a damaged step raises
    CheckpointCorruptError, or with ``fallback=True`` warns and loads the newest older step that checks. A step
    saved some other way (a background save, raw bytes) is restored, verified, and its file loaded.

    ``mmap=True`` checks the whole file first, then loads it with ``torch.load(mmap=True)``: the tensors are not
    copied but share memory with the file (the step's own on local disk; on other stores, or for a step saved
    some other way, its restored copy in the manager's folder), read from it as they are first touched. Writes to
    them stay in this process (a private mapping: the file never changes), and the file's disk space is freed
    only once they are gone, even after the step is deleted.

    ``broadcast=True``, called by every rank of a ``torch.distributed`` process group together: the step's file is
    read from the store once among the ranks and sent to the others, each rank checking every piece it received
    (:meth:`CheckpointManager.restore <taskpoint.CheckpointManager.restore>`), then loaded from that local copy.
    """
    if into is not None:
        return await anyio.to_thread.run_sync(_load_into, manager, step, into, strict, fallback, map_location,
                                              broadcast)
    return await anyio.to_thread.run_sync(lambda: load_state_dict_sync(
        manager, step, fallback=fallback, map_location=map_location, mmap=mmap, broadcast=broadcast))


def _load_into(manager: CheckpointManager, step: int | None, into: torch.nn.Module, strict: bool, fallback: bool,
               map_location: Any, broadcast: bool = False) -> int | RestoreReport | None:
    if fallback:
        raise TypeError("fallback=True restores an older step when one is damaged; with into= restore a chosen "
                        "step instead (the step restored into a model must be the one reported)")
    return restore_into(manager, step, strict, lambda saved, found: [module_plan(into, saved, "", found)],
                        map_location=map_location, broadcast=broadcast)


#: Checks a saved state dict against a target, noting what does not match; what restores each part that fits.
Planner = Callable[[dict[str, Any], Mismatches], list[Apply | None]]


def restore_into(manager: CheckpointManager, step: int | None, strict: bool, plan: Planner, *,
                 map_location: Any = None, broadcast: bool = False) -> int | RestoreReport | None:
    """Load ``step`` (the newest when None), check it against a target with ``plan``, then restore it: nothing
    when strict and anything differs (RestoreMismatch naming it), else every part that fits. The step restored
    when strict, else the report of what was not; None when there is no step."""
    number = manager.latest_step() if step is None else step
    if number is None:
        return None
    saved = load_state_dict_sync(manager, number, map_location=map_location, broadcast=broadcast)
    assert saved is not None
    found = Mismatches()
    actions = plan(saved, found)
    report = found.report(number)
    if strict and not report.complete:
        raise RestoreMismatch(report, f"step {number} in {manager.directory}")
    for action in actions:
        if action is not None:
            action()
    return number if strict else report


def _load_step(manager: CheckpointManager, step: int, map_location: Any, mmap: bool, broadcast: bool
               ) -> dict[str, Any]:
    if part_kind(manager, step) != STEP_KIND:  # saved another way: its payload, restored and verified whole
        return _load_file(manager.restore(step, broadcast=broadcast), map_location, mmap)
    if broadcast or (mmap and fsspec.utils.get_protocol(manager.directory) not in ("file", "local")):
        return _load_file(manager.restore(step, broadcast=broadcast) / STATE_FILE, map_location, mmap)  # verified
    with manager.open(step, STATE_FILE) as source:
        pieces = cast("PieceReader", source.raw)
        if mmap:  # the step's own file, checked whole through the open file, then mapped
            pieces.verify_all()
            return _load_file(Path(source.name), map_location, mmap)
        try:
            loaded = cast("dict[str, Any]", torch.load(source, map_location=map_location, weights_only=True))
        except Exception:
            # torch.load reads through C++, which does not always pass on what a read raised (a damaged piece
            # past the first surfaced as "ValueError: read of closed file"): the piece's own error when one differs.
            pieces.verify_all()
            raise
        pieces.verify_all()  # also what torch.load never read: every piece, and no byte past the end
        return loaded


def _load_file(path: Path, map_location: Any, mmap: bool) -> dict[str, Any]:
    """``torch.load`` of a local file that was checked whole."""
    return cast("dict[str, Any]", torch.load(path, map_location=map_location, weights_only=True, mmap=mmap))
