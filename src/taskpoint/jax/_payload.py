"""The ``pytree`` payload kind: a :class:`PyTree` saved as a directory checkpoint, and loading it back.

A :class:`~taskpoint.Checkpoint` serializes the tree with Orbax into a private temp folder, then the folder
travels as any directory does: streamed as a tar archive, atomically, with its sha256 recorded and verified on
load. A :class:`~taskpoint.CheckpointManager` saves it as its own step kind (:mod:`._kind`): Orbax's files in
the step's folder, each hashed.
"""

from __future__ import annotations

import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import anyio.to_thread

from ..checkpoint import BaseCheckpoint, Checkpoint
from ..manager import CheckpointManager
from ..payloads import DirectoryPayload, Payload, register_payload
from ..workspace import owned_folder, sweep_dead_folders
from ._pytree import PyTree, write_tree
from ._read import read_tree

#: Prefix of the temp folders where trees are serialized before upload (below ``$TMPDIR``), followed by
#: ``<host>-<pid>-`` so that those of killed processes can be swept.
SERIALIZE_PREFIX = "taskpoint-pytree-"


class PyTreePayload(DirectoryPayload):
    """A :class:`PyTree`, written, restored and published as a directory.

    Serialized once, when first needed: by a blocking save of a :class:`~taskpoint.CheckpointManager` on local
    disk into the step's folder (:meth:`write_into`, the ``jax.pytree`` step kind: Orbax writes where the step
    keeps it, no copy), else into a private temp folder (:meth:`serialized`), at the latest when a background
    save snapshots it, so that the caller may change its arrays as soon as the save call returns.
    """

    kind = "pytree"

    def __init__(self, tree: PyTree) -> None:
        self._tree: Any = tree.tree
        self._folder: Path | None = None
        self._remove: weakref.finalize[Any, Any] | None = None

    @property
    def _path(self) -> Path:  # type: ignore[override]  # DirectoryPayload's folder, serialized on first use
        return self.serialized()

    def serialized(self) -> Path:
        """The tree's folder, serialized into a private temp folder on the first call."""
        if self._folder is None:
            folder = owned_folder(SERIALIZE_PREFIX)
            # Each is as large as the tree: those that killed saving processes left must not pile up.
            sweep_dead_folders(folder.parent, SERIALIZE_PREFIX)
            # The folder lives as long as the payload (through retried uploads and background saves).
            self._remove = weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)
            try:
                write_tree(self._tree, folder)
            except BaseException:
                self._remove()
                raise
            self._folder, self._tree = folder, None
        return self._folder

    @property
    def is_serialized(self) -> bool:
        """Whether the tree was serialized into its temp folder already (a background save's snapshot)."""
        return self._folder is not None

    def write_into(self, folder: Path) -> None:
        """Serialize the tree into ``folder`` (which must not exist), Orbax writing there directly, instead of
        into a temp folder; only before :meth:`serialized` was called."""
        if self._folder is not None:
            raise RuntimeError("the tree was serialized into a temp folder already")
        folder.mkdir()
        write_tree(self._tree, folder)

    @classmethod
    def claim(cls, data: object) -> Payload | None:
        return cls(data) if isinstance(data, PyTree) else None

    def snapshot(self, scratch: Path) -> Payload:
        self.serialized()  # the caller may change the tree's arrays once the save call returns
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled only to send the upload to the manager's save process, where the folder's bytes are all
        # that is needed: a plain directory payload there, so that process never imports jax. The folder
        # stays until this object (held by the background save) is gone.
        return DirectoryPayload, (self.serialized(),)


register_payload(PyTreePayload)


Source = BaseCheckpoint | CheckpointManager | str | os.PathLike[str]


def load_pytree_sync(cp: Source, target: Any = None, *, step: int | None = None) -> Any:
    """Blocking twin of :func:`load_pytree`."""
    if isinstance(cp, CheckpointManager):
        return _from_manager(cp, target, step)
    _no_step(cp, step)
    folder = cp.load_sync() if isinstance(cp, BaseCheckpoint) else Path(os.fspath(cp))
    return None if folder is None else read_tree(folder, target, _where(cp))


async def load_pytree(cp: Source, target: Any = None, *, step: int | None = None) -> Any:
    """The tree saved as ``taskpoint.jax.PyTree(tree)``; None when there is no previous checkpoint.

    ``cp`` is a :class:`~taskpoint.Checkpoint` (its previous checkpoint is loaded), a
    :class:`~taskpoint.CheckpointManager` (``step`` is restored, the newest when None; None when it has no
    step), or the local folder that :meth:`CheckpointManager.restore <taskpoint.CheckpointManager.restore>`
    returned. Without ``target`` the tree comes back with the containers it was saved with (registered nodes
    such as namedtuples and dataclasses as dicts) and jax arrays on the default device. With ``target`` (a tree
    of arrays or ``jax.ShapeDtypeStruct``) it has the target's structure, dtypes and shardings; a target that
    does not match raises ValueError naming the first path that differs, and the checkpoint's URI (with a
    manager, the step and its directory; a folder is all a bare folder can name).
    """
    if isinstance(cp, CheckpointManager):
        return await anyio.to_thread.run_sync(_from_manager, cp, target, step)
    _no_step(cp, step)
    folder = await cp.load() if isinstance(cp, BaseCheckpoint) else Path(os.fspath(cp))
    return None if folder is None else await anyio.to_thread.run_sync(read_tree, folder, target, _where(cp))


def _from_manager(manager: CheckpointManager, target: Any, step: int | None) -> Any:
    """``step`` of ``manager`` (the newest when None; None when it has none), named by step and directory in
    messages: the folder it is restored into is the manager's own, gone once it closes."""
    if step is None and manager.latest_step() is None:
        return None
    folder = manager.restore(step)
    return read_tree(folder, target, f"step {manager.restored_step} in {manager.directory}")


def _no_step(cp: Source, step: int | None) -> None:
    if step is not None:
        raise TypeError(f"step= is for a CheckpointManager, not a {type(cp).__name__}")


def _where(cp: Source) -> str | None:
    """What messages call the checkpoint: a Checkpoint's source URI, not the workspace it was loaded into."""
    source = cp.remote_source if isinstance(cp, Checkpoint) else None
    return f"the checkpoint at {source}" if source else None
