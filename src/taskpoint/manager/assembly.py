"""The parts of one manager, made of its directory, its option values (:mod:`.options`) and its other keywords:
the step store, the kinds' parts, the background saves, the local tier, and the two sides the manager's methods
call, its read side (:mod:`.queries`) and its write side (:mod:`.writes`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..format.codecs import step_codec
from ..payloads import registered_payloads
from ..storage import RetryPolicy
from ..storage.location import Location
from ._checks import check_grace
from .agreement import AGREEMENT_FOLDER, Agreement
from .attempts import running_attempt
from .background import Background
from .chunks import ChunkStore
from .commit import StepWriter
from .dedup import Dedup
from .emergency import PreemptionPolicy
from .in_use import InUse
from .kinds import KINDS, StepContext
from .kinds.chunked import CHUNKED
from .kinds.payload import PAYLOAD
from .kinds.sharded import SHARDED
from .options import Options
from .protect import Guard
from .queries import StepQueries
from .rebuild import Rebuilder
from .restore import StepReader
from .schedule import SaveSchedule
from .shards import RankPlan, save_round
from .steps import StepStore
from .tiers import LocalTier, OpenLocal
from .writes import StepWrites


@dataclass(frozen=True)
class Assembly:
    """What a manager keeps of its parts: those its methods use, those its tests look into (the deduplicated
    saves, the local tier, the background saves), and its two sides."""

    steps: StepStore
    context: StepContext
    dedup: Dedup
    background: Background
    tier: LocalTier | None
    queries: StepQueries
    writes: StepWrites


def assemble(uri: str, options: Options, *, storage_options: dict[str, Any] | None, codec: str | None,
             level: int | None, retry: RetryPolicy | None, grace_seconds: float, dedup: bool, preemption: bool,
             on_preemption: Callable[[], Any] | None, open_local: OpenLocal) -> Assembly:
    """The parts of the manager of ``uri`` (checked by :func:`._checks.check_directory`). ``open_local`` opens the
    local manager of ``options.tier`` (the manager's own class). Checks the keywords that are not option values,
    and the options against each other (:meth:`.shards.RankPlan.from_args`, :meth:`.tiers.LocalTier.open`)."""
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict, not {type(storage_options).__name__}")
    if level is not None and (not isinstance(level, int) or isinstance(level, bool)):
        raise TypeError(f"level must be an int or None, not {type(level).__name__}")
    grace, ranks, saves, encoding = check_grace(grace_seconds), options.shards, options.background, step_codec(codec)
    plan = RankPlan.from_args(ranks.rank, ranks.world_size, ranks.commit_timeout, grace, bool(dedup))
    root = Location(uri, storage_options, retry)
    schedule = SaveSchedule(options.schedule.save_interval_steps, options.schedule.save_interval)
    in_use = InUse((str(root.fs.protocol), root.path))
    steps = StepStore(root, in_use, KINDS)
    chunks = ChunkStore(root, "zstd" if codec is None else codec, level)
    chunked = Dedup(steps, chunks, grace)
    agreement = Agreement(plan.ranks, plan.commit_timeout, root.child(AGREEMENT_FOLDER),
                          lambda: save_round(running_attempt()), lambda: queries.restored_step)
    context = StepContext(steps, encoding, level, grace, plan, Rebuilder(steps, chunks, chunked.workers),
                  chunked if dedup else None, agreement.while_committing)
    reader = StepReader(context, in_use, KINDS)
    guard = Guard(steps, in_use, options.retention, grace)
    # The first segment is made ahead only where the manager's own saves stage (no tier, dedup or ranks in between).
    ahead = None if options.tier or dedup or plan.ranks.distributed else functools.partial(staged_size, steps)
    background = Background(uri, None if saves.snapshot_dir is None else os.fspath(saves.snapshot_dir),
                            bool(saves.background_process) and root.backend.shared,
                            max_staging_bytes=saves.max_staging_bytes, prestart=bool(saves.async_save),
                            ahead=ahead)
    # The kinds a payload is saved as, the first that accepts it (dedup=True, a plug-in's, else one object); with
    # several ranks, each rank stores its part through it and rank 0 commits the step.
    writer = StepWriter(context, in_use, guard, KINDS, (CHUNKED, PAYLOAD),
                        SHARDED.around if plan.ranks.distributed else None)
    tier = None if options.tier is None else LocalTier.open(open_local, options.tier, saves, {
        "codec": codec, "level": level, "retry": retry, "grace_seconds": grace_seconds, "dedup": dedup,
    }, (context, writer, background, guard.committed))
    queries = StepQueries(context, reader, guard, schedule, tier, background)
    writes = StepWrites(context, writer, reader, guard, schedule, background, tier,
                        PreemptionPolicy(preemption, on_preemption, agreement), chunked, queries,
                        bool(saves.async_save))
    return Assembly(steps, context, chunked, background, tier, queries, writes)


def staged_size(steps: StepStore) -> int | None:
    """The bytes of the state the newest committed step of ``steps`` holds, as the sizes its manifest records tell (a
    state dict's file, a PyTree's files: a little more than its tensors or arrays), when it is the step of a payload
    that a background save stages through a module of its own (:attr:`~taskpoint.payloads.Payload.staged_by`: a state
    dict, a PyTree; not bytes, whose step may as well be a file's); else None. A manager that resumes makes its
    first staging segment ahead at this size (:meth:`.staging_memory.StagingMemory.prepare`)."""
    staged = {(getattr(cls, "staged_kind", None), cls.kind) for cls in registered_payloads() if cls.staged_by}
    committed = steps.committed_steps()
    manifest = steps.manifest(max(committed), tolerate_corrupt=True) if committed else None
    if manifest is None or (manifest.kind, manifest.record.kind) not in staged:
        return None
    return sum(size or 0 for size in steps.named(manifest.step, manifest).files.values()) or None
