"""The kind API: everything a step kind needs from the manager, in one module.

A step kind (:class:`StepKind`) decodes its manifests' content, stores a step's objects and says what it stored
(:class:`Stored`: the content (a :class:`StepContent`) and record (an :class:`ObjectRecord`) its manifest holds,
and the objects it names with their sizes), and restores, verifies, lists, describes and deletes the steps it
stored. It never writes a manifest: the manager checks what was stored and commits the step, writing the manifest
last; a writer of another package stores a step where :func:`step_folder` says (with a local tier, on it) and
calls ``manager.commit``. ``taskpoint.torch`` and ``taskpoint.jax`` import nothing else of
:mod:`taskpoint.manager` (besides its public names, :class:`~taskpoint.CheckpointManager` and
:func:`~taskpoint.manager.check_step`), and nor need a kind of another package; ``tests/test_kind_contract.py``
holds the contract a kind keeps (docs/manager.md, "Step kinds").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..format.records import ObjectRecord, StepContent, StepManifest
from ..storage import Location
from ._checks import check_step
from .background import store_staged
from .kinds import (
    GONE_HOW,
    Checked,
    Described,
    Gone,
    InPlaceKind,
    PartialKind,
    SaveJob,
    StepContext,
    StepKind,
    content_of,
    read_object,
    register_step_kind,
    stored_part,
)
from .kinds.files import FilesKind, store_folder, store_listing, stored_files, write_folder, write_listing
from .kinds.sharded import RANKS
from .staging import Segment
from .step_commit import Stored
from .step_names import MANIFEST_NAME, name_in, stored_names
from .steps import StepObjects, StepStore, best_effort, save_clock

if TYPE_CHECKING:
    from .manager import CheckpointManager

__all__ = ["GONE_HOW", "MANIFEST_NAME", "Checked", "Described", "FilesKind", "Gone", "InPlaceKind", "ObjectRecord",
           "PartialKind", "SaveJob", "Segment", "StepContent", "StepContext", "StepKind", "StepManifest", "StepObjects",
           "StepStore", "Stored", "best_effort", "content_of", "name_in", "part_kind", "read_object",
           "register_step_kind", "save_clock", "step_folder", "store_folder", "store_listing", "store_staged",
           "stored_files", "stored_names", "stored_part", "write_folder", "write_listing"]


def step_folder(manager: CheckpointManager, step: int, *, reading: bool = False) -> Location:
    """The folder of ``manager``'s ``step`` for a writer of another package (``taskpoint.torch``'s
    ``Writer.for_step``), which stores the step's objects there and then calls ``manager.commit``: with a local
    tier the step's folder on it (the commit there promotes the step as a save's is), else :meth:`step_uri
    <taskpoint.CheckpointManager.step_uri>`. ``reading``: the folder its reader reads, the local copy when a
    restore would read it (the committed step's), else the remote one. ValueError for a writer of several ranks
    with a local tier (:meth:`.tiers.LocalTier.folder`)."""
    step, tier = check_step(step), manager._tier
    if tier is None:
        return manager._steps.folder(step)
    return tier.folder(step, reading=reading)


def part_kind(manager: CheckpointManager, step: int) -> str:
    """The kind of step that holds this rank's data of ``manager``'s ``step``, what a reader of another package
    (``taskpoint.torch``'s state dicts) loads it as: the step's own kind, or in a step of several ranks whose
    parts are of other kinds than a payload object (:mod:`.kinds.sharded`), this rank's part's."""
    described = manager.describe(step)
    if described.kind != RANKS.name:
        return described.kind
    return str(described.details["shards"][manager.rank]["step_kind"])
