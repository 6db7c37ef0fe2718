"""Loading a :class:`~taskpoint.jax.PyTree` back: from a Checkpoint, a local folder, or a manager's step, which on
local disk Orbax reads where it lies once every file of it is verified (:mod:`._kind`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio.to_thread

from ..checkpoint import BaseCheckpoint, Checkpoint
from ..manager import CheckpointManager
from ._kind import lost_in_place
from ._read import read_tree

Source = BaseCheckpoint | CheckpointManager | str | os.PathLike[str]


def load_pytree_sync(cp: Source, target: Any = None, *, step: int | None = None, strict: bool = True,
                     broadcast: bool = False) -> Any:
    """Blocking twin of :func:`load_pytree`."""
    if isinstance(cp, CheckpointManager):
        return _from_manager(cp, target, step, strict=strict, broadcast=broadcast)
    _no_step(cp, step, broadcast)
    folder = cp.load_sync() if isinstance(cp, BaseCheckpoint) else Path(os.fspath(cp))
    return None if folder is None else read_tree(folder, target, _where(cp), strict=strict)


async def load_pytree(cp: Source, target: Any = None, *, step: int | None = None, strict: bool = True,
                      broadcast: bool = False) -> Any:
    """The tree saved as ``taskpoint.jax.PyTree(tree)``; None when there is no previous checkpoint.

    ``cp`` is a :class:`~taskpoint.Checkpoint` (its previous checkpoint is loaded), a
    :class:`~taskpoint.CheckpointManager` (``step`` is restored, the newest when None; None when it has no
    step), or the local folder that :meth:`CheckpointManager.restore <taskpoint.CheckpointManager.restore>`
    returned. A manager's step on local disk is read in place, without a copy: every file is checked against its
    sha256 first (damage raises CheckpointCorruptError before Orbax reads anything), and the step is kept from
    retention and ``delete`` until Orbax has read it. Without ``target`` the tree comes back with the containers
    it was saved with (registered nodes such as namedtuples and dataclasses as dicts) and jax arrays on the
    default device. With ``target`` (a tree of arrays or ``jax.ShapeDtypeStruct``) it has the target's
    structure, dtypes (arrays are cast to the target's) and shardings. Leaves of the target missing from the
    checkpoint, leaves of the checkpoint the target lacks, and leaves of another shape or kind raise
    :class:`~taskpoint.errors.RestoreMismatch` (a ValueError) naming the first few and how many, and the
    checkpoint's URI (with a manager, the step and its directory; a folder is all a bare folder can name); nothing
    is returned. ``strict=False`` returns ``(tree, report)`` instead: the leaves that match restored, the others
    left as the target's own, and a :class:`~taskpoint.errors.RestoreReport` listing them.

    ``broadcast=True`` (a manager's step, on every rank of a ``torch.distributed`` process group together): the
    step's files are read from the store once among the ranks and sent to the others, each rank checking every file
    against its digests in its local copy before Orbax reads it there (:meth:`CheckpointManager.restore_in_place
    <taskpoint.CheckpointManager.restore_in_place>`).
    """
    if isinstance(cp, CheckpointManager):
        return await anyio.to_thread.run_sync(
            lambda: _from_manager(cp, target, step, strict=strict, broadcast=broadcast))
    _no_step(cp, step, broadcast)
    folder = await cp.load() if isinstance(cp, BaseCheckpoint) else Path(os.fspath(cp))
    return None if folder is None else await anyio.to_thread.run_sync(
        lambda: read_tree(folder, target, _where(cp), strict=strict))


def _from_manager(manager: CheckpointManager, target: Any, step: int | None, *, where: str | None = None,
                  progress: Any = None, strict: bool = True, broadcast: bool = False) -> Any:
    """``step`` of ``manager`` (the newest when None; None when it has none), named by step and directory in
    messages (or ``where``), read through :meth:`CheckpointManager.restore_in_place
    <taskpoint.CheckpointManager.restore_in_place>` (``progress`` and ``broadcast`` as there).

    Only another process can take files from under Orbax's read in place (overwriting the step, or deleting it
    with ``force=True``): when Orbax fails and the folder has lost files, the step is restored as a copy instead,
    which follows an overwrite or reports the step gone, as a restore does."""
    if step is None and manager.latest_step() is None:
        return None
    with manager.restore_in_place(step, progress=progress, broadcast=broadcast) as folder:
        try:
            return read_tree(folder, target, where or _step_where(manager), strict=strict,
                             step=manager.restored_step)
        except Exception:
            if not lost_in_place(folder):
                raise
    return read_tree(manager.restore(step, broadcast=broadcast), target, where or _step_where(manager),
                     strict=strict, step=manager.restored_step)


def _step_where(manager: CheckpointManager) -> str:
    return f"step {manager.restored_step} in {manager.directory}"


def _no_step(cp: Source, step: int | None, broadcast: bool) -> None:
    for name, given in (("step", step is not None), ("broadcast", broadcast)):
        if given:
            raise TypeError(f"{name}= is for a CheckpointManager, not a {type(cp).__name__}")


def _where(cp: Source) -> str | None:
    """What messages call the checkpoint: a Checkpoint's source URI, not the workspace it was loaded into."""
    source = cp.remote_source if isinstance(cp, Checkpoint) else None
    return f"the checkpoint at {source}" if source else None
