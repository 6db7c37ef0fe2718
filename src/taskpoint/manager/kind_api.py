"""The kind API: everything a step kind needs from the manager, in one module.

A step kind (:class:`StepKind`) decodes its manifests' content, stores a step's objects and says what it stored
(:class:`Stored`: the content (a :class:`StepContent`) and record (an :class:`ObjectRecord`) its manifest holds,
and the objects it names with their sizes), and restores, verifies, lists, describes and deletes the steps it
stored. It never writes a manifest: the manager checks what was stored and commits the step, writing the manifest
last. ``taskpoint.torch`` and ``taskpoint.jax`` import nothing else of :mod:`taskpoint.manager` (besides its public
names, :class:`~taskpoint.CheckpointManager` and :func:`~taskpoint.manager.check_step`), and nor need a kind of
another package; ``tests/test_kind_contract.py`` holds the contract a kind keeps (docs/manager.md, "Step kinds").
"""

from ..format.records import ObjectRecord, StepContent, StepManifest
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
from .staging import Segment
from .step_commit import Stored
from .step_names import MANIFEST_NAME, name_in, stored_names
from .steps import StepObjects, StepStore, best_effort, save_clock

__all__ = ["GONE_HOW", "MANIFEST_NAME", "Checked", "Described", "Gone", "InPlaceKind", "ObjectRecord", "PartialKind",
           "SaveJob", "Segment", "StepContent", "StepContext", "StepKind", "StepManifest", "StepObjects", "StepStore",
           "Stored", "best_effort", "content_of", "name_in", "read_object", "register_step_kind", "save_clock",
           "store_staged", "stored_names", "stored_part"]
