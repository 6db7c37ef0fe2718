"""The ``pytree`` payload kind: a :class:`PyTree` saved as a directory checkpoint (:mod:`._load` loads it back).

A :class:`~taskpoint.Checkpoint` serializes the tree with Orbax into a private temp folder, then the folder
travels as any directory does: streamed as a tar archive, atomically, with its sha256 recorded and verified on
load. A :class:`~taskpoint.CheckpointManager` saves it as its own step kind (:mod:`._kind`): Orbax's files in
the step's folder, each hashed.
"""

from __future__ import annotations

import shutil
import weakref
from pathlib import Path
from typing import Any

from ..manager.kind_api import Segment
from ..payloads import DirectoryPayload, Payload, register_payload
from ..workspace import owned_folder, sweep_dead_folders
from ._pytree import KIND, PAYLOAD_KIND, Encoded, PyTree, encode
from ._staged import TreePlan

#: Prefix of the temp folders where trees are serialized before upload (below ``$TMPDIR``), followed by
#: ``<host>-<pid>-`` so that those of killed processes can be swept.
SERIALIZE_PREFIX = "taskpoint-pytree-"


class PyTreePayload(DirectoryPayload):
    """A :class:`PyTree`, written, restored and published as a directory.

    Serialized once, when first needed: by a blocking save of a :class:`~taskpoint.CheckpointManager` on local
    disk into the step's folder (:meth:`write_into`, the ``jax.pytree`` step kind: Orbax writes where the step
    keeps it, no copy), else into a private temp folder (:meth:`serialized`), at the latest when a background
    save snapshots it, so that the caller may change its arrays as soon as the save call returns. A background
    save of a manager with a save process stages its arrays instead (:meth:`stage`, :mod:`._staged`); the save
    process then writes the same folder from the segment, through a payload of this class made of the
    :class:`~._pytree.Encoded` tree.
    """

    kind = PAYLOAD_KIND
    staged_by = "taskpoint.jax._kind"
    staged_kind = KIND

    def __init__(self, tree: PyTree | Encoded) -> None:
        self._tree: Any = tree.tree if isinstance(tree, PyTree) else tree
        self._folder: Path | None = None
        self._remove: weakref.finalize[Any, Any] | None = None
        self._plan: TreePlan | None = None

    def _write(self, folder: Path) -> None:
        (self._tree if isinstance(self._tree, Encoded) else encode(self._tree)).write(folder)

    def staging_size(self) -> int | None:
        """The bytes a background save stages this tree's arrays in (:mod:`._staged`), or None when it cannot be
        staged (it is then serialized into its temp folder, as before)."""
        if self._folder is not None:
            return None
        self._tree = encoded = self._tree if isinstance(self._tree, Encoded) else encode(self._tree)
        self._plan = TreePlan(encoded)
        return self._plan.size

    def stage(self, segment: Segment) -> Payload:
        """Copy the tree's arrays into ``segment`` (after :meth:`staging_size`); what the save then writes."""
        assert self._plan is not None
        plan, self._plan = self._plan, None
        return plan.copy_into(segment)

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
                self._write(folder)
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
        self._write(folder)

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
