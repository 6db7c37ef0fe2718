"""The manager layer: numbered steps in one directory, each committed by a manifest written last.

Owns: :class:`CheckpointManager` (a facade over its read and write sides, ``queries`` and ``writes``, made of its
option values, ``options``, by ``assembly``), the step layout (``step_names``) and sweeping of
leftovers (``steps``), retention as a policy (``retention``, with :class:`KeepBest`), the steps it never deletes
(``protect``), when to save (``schedule``), verified restores (``restore``), background saves with snapshots
(``background``) and the process they upload from (``saver``), steps saved by several ranks and rank 0's
commit of them (``shards``), the local tier and its promotions to the remote directory (``tiers``,
``promotion``), the steps this process is restoring or deleting (``in_use``), the step
kinds behind a :class:`StepKind` protocol, one module each (``kinds``), and verification, description and the
listing of steps as typed results (``verify``, ``inventory``).

May import: :mod:`taskpoint.checkpoint`'s layer and everything below it (``transfer``, ``payloads``,
``workspace``, ``format``, ``storage``, ``errors``). It never imports :mod:`taskpoint.runtime`:
``taskpoint/__init__.py`` hands it the runtime's lookup of the running attempt through :func:`set_attempt_source`.
"""

from ._checks import check_step
from .attempts import set_attempt_source
from .inventory import StepSummary
from .kinds import StepKind, register_step_kind
from .manager import CheckpointManager
from .options import BackgroundSaves, Retention, Schedule, Shards, Tier
from .retention import KeepBest
from .step_names import MANIFEST_NAME, STEP_FOLDER
from .verify import StepDescription, StepVerification, Verification

__all__ = ["MANIFEST_NAME", "STEP_FOLDER", "BackgroundSaves", "CheckpointManager", "KeepBest", "Retention", "Schedule",
           "Shards", "StepDescription", "StepKind", "StepSummary", "StepVerification", "Tier", "Verification",
           "check_step", "register_step_kind", "set_attempt_source"]
