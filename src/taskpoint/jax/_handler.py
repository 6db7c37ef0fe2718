"""OrbaxCheckpointHandler: Datarax's checkpoint handler, on CheckpointManager and any fsspec store.

Layout under ``directory`` (any fsspec URL)::

    ckpt-{step}/           a versioned save: one step of a CheckpointManager rooted at ``directory``
    checkpoint/ckpt-0/     a save with ``step=None``: the only step of a CheckpointManager rooted at
                           ``directory/checkpoint``

Both are written with the manager's commit protocol (payload first, manifest last), so an interrupted
save never looks complete, and the unversioned checkpoint gets the same metadata, overwrite rule and
background saves as the versioned ones. Each step holds a ``taskpoint.jax.PyTree`` payload.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import fsspec.utils
from fsspec.callbacks import Callback

from ..errors import CheckpointError, RestoreReport
from ..manager import BackgroundSaves, CheckpointManager, Retention, check_step
from ._load import _from_manager
from ._pytree import PyTree
from ._read import read_tree

#: Folder of the unversioned checkpoint (``step=None``), and the step it is saved as inside it.
UNVERSIONED_FOLDER = "checkpoint"
UNVERSIONED_STEP = 0


class _Unset:
    """Marks "keep not given": a query uses the directory's manager whatever its retention."""


_UNSET = _Unset()


@runtime_checkable
class Checkpointable(Protocol):
    """An object that saves and restores its own state as a PyTree (a dict of arrays, scalars, str...)."""

    def get_state(self) -> dict[str, Any]:
        """The state to save."""

    def set_state(self, state: dict[str, Any]) -> None:
        """Replace the object's state with a restored one."""


class Checkpointer:
    """What :attr:`OrbaxCheckpointHandler.checkpointer` is: the calls Datarax code makes on Orbax's
    checkpointer (``save``, ``restore``, ``wait_until_finished``, ``close``), on taskpoint's managers.

    The handler makes every save and restore through it, so code that reaches for ``handler.checkpointer``
    reads and writes the same checkpoints as the handler. A ``directory`` whose last segment is ``ckpt-N``
    is step ``N`` of a :class:`~taskpoint.CheckpointManager` at its parent (``handler.save(d, t, step=N)``
    writes ``d/ckpt-N``); any other directory is the only step (0) of a manager rooted there, the layout of
    ``handler.save(d, t)`` at ``d/checkpoint``. ``state`` is a PyTree, saved as :class:`~taskpoint.jax.PyTree`.
    """

    def __init__(self, async_save: bool, storage_options: dict[str, Any] | None) -> None:
        self._async_save = async_save
        self._storage_options = storage_options
        self._lock = threading.Lock()
        self._managers: dict[str, tuple[CheckpointManager, int | None]] = {}
        self._closed = False

    def save(self, directory: str | os.PathLike[str], state: Any, force: bool = False, *,
             keep: int | None = None, metadata: dict[str, Any] | None = None,
             progress: bool | Callback | None = None) -> str:
        """Save ``state`` at ``directory`` (``.../ckpt-N`` or an unversioned folder); ``force`` overwrites.
        ``keep`` (steps only) keeps the ``keep`` newest steps; ``metadata`` is a dict of JSON values; ``progress``
        as for :meth:`CheckpointManager.save <taskpoint.CheckpointManager.save>`. Returns the checkpoint's URI.
        With ``async_checkpointing``, returns once the state is on local disk."""
        parent, step = _split(directory)
        payload = state if isinstance(state, PyTree) else PyTree(state)
        if step is None:
            manager = self.manager(directory, None)
            manager.save(payload, UNVERSIONED_STEP, metadata=metadata, overwrite=force, progress=progress)
            return manager.directory
        return self.manager(parent, keep).save(payload, step, metadata=metadata, overwrite=force, progress=progress)

    def restore(self, directory: str | os.PathLike[str], item: Any = None, *,
                progress: bool | Callback | None = None, strict: bool = True) -> Any:
        """The tree saved at ``directory``, shaped like ``item`` when given (see
        :func:`~taskpoint.jax.load_pytree`, and for ``strict``); waits for a save in flight there first.
        FileNotFoundError when nothing was saved there. ``progress`` as for :meth:`CheckpointManager.restore
        <taskpoint.CheckpointManager.restore>`."""
        manager, step = self._located(directory)
        manager.wait_until_finished()
        # Messages name the step and its URI, not the folder Orbax read.
        where = (f"the checkpoint at {manager.directory}" if step == UNVERSIONED_STEP
                 else f"step {step} in {manager.directory}")
        if fsspec.utils.get_protocol(manager.directory) in ("file", "local"):
            # A PyTree step on local disk is read where it lies once every file of it is verified (no copy).
            return _from_manager(manager, item, step, where=where, progress=progress, strict=strict)
        with tempfile.TemporaryDirectory(prefix="taskpoint-restore-") as scratch:  # gone once this returns
            return read_tree(manager.restore(step, into=scratch, progress=progress), item, where, strict=strict,
                             step=step)

    def metadata(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """The metadata saved with the checkpoint at ``directory``, read without its payload."""
        manager, step = self._located(directory)
        manager.wait_until_finished()
        return manager.metadata(step)

    def wait_until_finished(self) -> None:
        """Block until every background save has committed; raise the first error one of them met."""
        _each(manager.wait_until_finished for manager in self.all_managers())

    def close(self) -> None:
        """Wait for background saves and release the managers; raise a background error. Safe to call twice."""
        with self._lock:
            self._closed = True
            managers, self._managers = [m for m, _ in self._managers.values()], {}
        _each(manager.close for manager in managers)

    def _located(self, directory: str | os.PathLike[str]) -> tuple[CheckpointManager, int]:
        parent, step = _split(directory)
        if step is None:
            return self.manager(directory), UNVERSIONED_STEP
        return self.manager(parent), step

    def manager(self, directory: str | os.PathLike[str], keep: int | _Unset | None = _UNSET) -> CheckpointManager:
        """The manager of ``directory``; a new one when ``keep`` (if given) differs from its retention."""
        key = _key(directory)
        with self._lock:
            if self._closed:
                raise CheckpointError("this OrbaxCheckpointHandler is closed; create a new one")
            current = self._managers.get(key)
            if current is not None and (isinstance(keep, _Unset) or current[1] == keep):
                return current[0]
            wanted = None if isinstance(keep, _Unset) else keep
            manager = CheckpointManager(directory, retention=Retention(keep=wanted),
                                        background=BackgroundSaves(async_save=self._async_save),
                                        storage_options=self._storage_options)
            self._managers[key] = (manager, wanted)
        if current is not None:
            current[0].close()  # waits for its background save; a later save there goes through the new one
        return manager

    def all_managers(self) -> list[CheckpointManager]:
        with self._lock:
            return [manager for manager, _ in self._managers.values()]


class OrbaxCheckpointHandler:
    """Save and restore Checkpointable objects, ``flax.nnx`` modules and PyTrees by step, on any store.

    The surface of Datarax's ``OrbaxCheckpointHandler``, on :class:`~taskpoint.CheckpointManager`: every
    ``directory`` is any fsspec URL or local path; retention keeps everything unless ``keep`` says
    otherwise and never counts a save that has not committed; leftovers of interrupted saves are removed by
    later saves once older than the manager's grace period; ``metadata_only`` reads only the metadata.
    As in Datarax, a target that is a :class:`Checkpointable` is saved and restored through its
    ``get_state``/``set_state`` even when it is also an ``nnx.Module`` (every Datarax module is both).

    Args:
        async_checkpointing: when True, :meth:`save` returns once the state is serialized to local disk and
            uploads in the background (one save in flight per directory); :meth:`wait_until_finished`,
            :meth:`close` or leaving the ``with`` block waits, and raises a background error.
        storage_options: passed to fsspec for every directory (credentials, endpoint_url, ...).

    Attributes:
        checkpointer: the :class:`Checkpointer` every save and restore goes through (Datarax's handler
            exposes its Orbax checkpointer under this name).
    """

    def __init__(self, async_checkpointing: bool = False, *, storage_options: dict[str, Any] | None = None) -> None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, not {type(storage_options).__name__}")
        self.async_checkpointing = bool(async_checkpointing)
        self.checkpointer = Checkpointer(self.async_checkpointing,
                                         dict(storage_options) if storage_options is not None else None)

    # -- lifecycle ---------------------------------------------------------------------------------------

    def __enter__(self) -> OrbaxCheckpointHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_until_finished(self) -> None:
        """Block until every background save has committed; raise the first error one of them met."""
        self.checkpointer.wait_until_finished()

    def close(self) -> None:
        """Wait for background saves and release the managers; raise a background error. Safe to call twice."""
        self.checkpointer.close()

    # -- save --------------------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike[str], target: Any, step: int | None = None, keep: int | None = None,
             overwrite: bool = False, metadata: dict[str, Any] | None = None, *,
             progress: bool | Callback | None = None) -> str:
        """Save ``target`` as ``step`` (``directory/ckpt-{step}``), or as ``directory/checkpoint`` when None.

        ``target`` is a :class:`Checkpointable` (its ``get_state()`` is saved), a ``flax.nnx.Module`` (its
        state) or a PyTree. ``keep`` keeps the ``keep`` newest steps (None, the default: all of them);
        deletion happens after the new step commits. Saving an existing step raises FileExistsError unless
        ``overwrite=True``. ``metadata`` is a dict of JSON values, given back by
        ``restore(..., metadata_only=True)``. ``progress``: True, False, None (a bar on a terminal for saves
        longer than about two seconds) or an ``fsspec.callbacks.Callback``. Returns the URI of the checkpoint.
        """
        state = _state_of(target)
        if step is None:
            return self.checkpointer.save(_join(directory, UNVERSIONED_FOLDER), state, force=overwrite,
                                          metadata=metadata, progress=progress)
        return self.checkpointer.save(_step_path(directory, check_step(step)), state, force=overwrite, keep=keep,
                                      metadata=metadata, progress=progress)

    save_to_directory = save

    # -- restore -----------------------------------------------------------------------------------------

    def restore(self, directory: str | os.PathLike[str], target: Any = None, step: int | None = None,
                metadata_only: bool = False, *, progress: bool | Callback | None = None, strict: bool = True) -> Any:
        """Restore ``step`` (None: the newest step, else ``directory/checkpoint``) into ``target``.

        A :class:`Checkpointable` gets the saved state through ``set_state`` and an ``nnx.Module`` is
        updated in place; both are returned. A PyTree target gives the restored tree its structure, dtypes
        and shardings, and the tree is returned. A target (PyTree or module) that does not match raises
        :class:`~taskpoint.errors.RestoreMismatch` (a ValueError) naming the leaves missing, unexpected or of
        another shape, and restores nothing; ``strict=False`` restores the leaves that match and returns
        ``(result, report)``, the :class:`~taskpoint.errors.RestoreReport` listing the others (a Checkpointable
        takes the saved state whole: its report is empty). With no target, the saved state is returned.
        ``metadata_only=True`` returns
        the metadata dict saved with the checkpoint and reads nothing else. Background saves to
        ``directory`` are waited for first. FileNotFoundError when there is nothing to restore. ``progress``
        as for :meth:`save` (a restore counts the stored bytes).
        """
        path = self._newest(directory) if step is None else _step_path(directory, check_step(step))
        if metadata_only:
            return self.checkpointer.metadata(path)
        return _apply(self.checkpointer, path, target, progress, strict)

    def _newest(self, directory: str | os.PathLike[str]) -> str:
        """The newest committed step's path when ``directory`` has one, else the unversioned checkpoint's."""
        versioned = self.checkpointer.manager(directory)
        versioned.wait_until_finished()
        latest = versioned.latest_step()
        if latest is not None:
            return _step_path(directory, latest)
        unversioned = self.checkpointer.manager(_join(directory, UNVERSIONED_FOLDER))
        unversioned.wait_until_finished()
        if unversioned.latest_step() is not None:
            return _join(directory, UNVERSIONED_FOLDER)
        raise FileNotFoundError(f"no checkpoint in {os.fspath(directory)}: no committed ckpt-{{step}} and no "
                                f"{UNVERSIONED_FOLDER}/")

    # -- queries -----------------------------------------------------------------------------------------

    def get_checkpoint_steps(self, directory: str | os.PathLike[str]) -> list[int]:
        """The committed steps in ``directory``, oldest first (a background save counts once committed)."""
        return self.checkpointer.manager(directory).steps()

    def latest_step(self, directory: str | os.PathLike[str]) -> int | None:
        """The newest committed step in ``directory``, or None."""
        return self.checkpointer.manager(directory).latest_step()

    def list_checkpoints(self, directory: str | os.PathLike[str]) -> dict[int, str]:
        """Each committed step in ``directory`` with the URI of its folder, oldest first."""
        return self.checkpointer.manager(directory).list_checkpoints()


def _state_of(target: Any) -> Any:
    """What is saved for ``target``: an nnx module's state as a pure dict, a Checkpointable's get_state()."""
    if isinstance(target, Checkpointable):  # first, as Datarax does: its modules are nnx modules too
        return target.get_state()
    nnx = _nnx()
    if nnx is not None and isinstance(target, nnx.Module):
        return nnx.to_pure_dict(nnx.state(target))
    return target


def _apply(checkpointer: Checkpointer, path: str, target: Any, progress: bool | Callback | None,
           strict: bool) -> Any:
    """Restore the tree at ``path`` into ``target`` as :meth:`OrbaxCheckpointHandler.restore` describes."""
    if isinstance(target, Checkpointable):  # first, as Datarax does (and as _state_of saved it)
        target.set_state(checkpointer.restore(path, progress=progress))
        return target if strict else (target, RestoreReport(_split(path)[1]))
    nnx = _nnx()
    if nnx is not None and isinstance(target, nnx.Module):
        state = nnx.state(target)
        restored = checkpointer.restore(path, item=nnx.to_pure_dict(state), progress=progress, strict=strict)
        tree, report = (restored, None) if strict else restored
        nnx.replace_by_pure_dict(state, tree)
        nnx.update(target, state)
        return target if strict else (target, report)
    return checkpointer.restore(path, item=target, progress=progress, strict=strict)


def _nnx() -> Any:
    """``flax.nnx`` when the program imported it (an nnx module can exist only then), else None."""
    return sys.modules.get("flax.nnx")


def _key(directory: str | os.PathLike[str]) -> str:
    text = os.fspath(directory).strip()
    if "://" not in text and "::" not in text:
        text = os.path.abspath(text)
    return text.rstrip("/") or "/"


def _join(directory: str | os.PathLike[str], name: str) -> str:
    return f"{os.fspath(directory).rstrip('/')}/{name}"


def _step_path(directory: str | os.PathLike[str], step: int) -> str:
    return _join(directory, f"ckpt-{step}")


_STEP_FOLDER = re.compile(r"ckpt-(\d+)")


def _split(directory: str | os.PathLike[str]) -> tuple[str, int | None]:
    """``(parent, N)`` for a path ending in ``ckpt-N``; ``(path, None)`` for any other."""
    text = os.fspath(directory).rstrip("/")
    parent, _, last = text.rpartition("/")
    match = _STEP_FOLDER.fullmatch(last)
    if match is None or not parent:
        return text, None
    return parent, int(match.group(1))


def _each(actions: Iterable[Callable[[], object]]) -> None:
    """Run every action even when some fail; then raise the first failure."""
    first: BaseException | None = None
    for action in actions:
        try:
            action()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
