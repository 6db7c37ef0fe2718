"""The option values of :class:`~taskpoint.CheckpointManager`: its keywords grouped by what they decide.

``CheckpointManager(path, retention=Retention(keep=3), background=BackgroundSaves(async_save=True))``. Each value
is frozen and checks its fields when it is made, so a bad one fails where it is written. :class:`Retention`
(:mod:`.retention`) and :class:`Schedule` (:mod:`.schedule`) live beside the code they configure;
:class:`BackgroundSaves`, :class:`Shards` and :class:`Tier` here. The keywords of the constructor from before the
option values (``keep=3``, ``async_save=True``, ...) are the fields of these values, under the same names, and are
still accepted: :meth:`Options.gather` makes the values of them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ..storage.location import normalize_uri
from ._checks import positive_or_none
from .retention import Retention
from .schedule import Schedule
from .staging import check_staging_bytes

__all__ = ["GROUPS", "BackgroundSaves", "Options", "Retention", "Schedule", "Shards", "Tier"]


#: How long rank 0 waits, by default, for every rank's shard of a step before abandoning it (seconds).
DEFAULT_COMMIT_TIMEOUT = 600.0


@dataclass(frozen=True)
class BackgroundSaves:
    """How background saves run: ``CheckpointManager(path, background=BackgroundSaves(...))``.

    Args:
        async_save: when True, :meth:`~taskpoint.CheckpointManager.save` returns once the data is snapshotted or
            staged (and handed to the save process, started with the manager, which then commits it even if this
            process dies) and uploads in the background (``save(..., blocking=...)`` overrides it per call).
        snapshot_dir: where background saves copy files and directories before uploading them (the system temp
            folder by default). The copy needs as much space as the data; on the source's filesystem it is
            fastest (in-kernel, or reflinked where the filesystem supports it).
        background_process: background saves to local disk and object stores write the snapshot from a helper
            process (True, the default) so they never hold this process's GIL; False writes it from a thread of
            this process. ``memory://`` and payloads that cannot be pickled always use a thread. Blocking saves
            always run in the caller's thread.
        max_staging_bytes: the shared memory that background saves of torch state dicts and JAX PyTrees (staged
            there for the save process) may hold at once; None: half the memory available (a larger state is saved
            blocking).
    """

    async_save: bool = False
    snapshot_dir: str | os.PathLike[str] | None = None
    background_process: bool = True
    max_staging_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.snapshot_dir is not None:
            normalize_uri(self.snapshot_dir, "snapshot_dir")
        check_staging_bytes(self.max_staging_bytes)


@dataclass(frozen=True)
class Shards:
    """The ranks that save each step together, each its own shard: ``CheckpointManager(path, shards=Shards(...))``.

    Args:
        rank: this process's rank among ``world_size`` ranks (default: from ``$TASKPOINT_RANK``, torchrun's
            ``RANK`` or Slurm's ``SLURM_PROCID``; else 0).
        world_size: how many ranks save each step (default: from ``$TASKPOINT_WORLD_SIZE``, ``WORLD_SIZE`` or
            ``SLURM_NTASKS``; else 1). Rank 0 commits a step once every rank's shard is stored (waiting up to
            ``commit_timeout`` seconds, then raising :class:`~taskpoint.StepAbandonedError`); other ranks' saves
            return once their shard is recorded. ``restore`` returns this rank's shard. See docs/manager.md.
        commit_timeout: how long rank 0 waits for every rank's shard of a step (seconds); shorter than the
            manager's ``grace_seconds`` with several ranks.

    The ranks not given are read from the environment when the manager is made (:mod:`taskpoint.ranks`, which
    also checks them).
    """

    rank: int | None = None
    world_size: int | None = None
    commit_timeout: float = DEFAULT_COMMIT_TIMEOUT

    def __post_init__(self) -> None:
        timeout = self.commit_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"commit_timeout must be a number of seconds > 0, got {timeout!r}")


@dataclass(frozen=True)
class Tier:
    """A local tier: ``CheckpointManager(path, tier=Tier(local_dir))``.

    Args:
        local_dir: a local path (the node's NVMe or RAM disk): each step is committed there first, and every
            ``remote_every``-th step is then promoted to the manager's directory in the background, checked
            against its local manifest. Reads see both tiers (``steps(tier=...)``). With several ranks each rank's
            local tier holds its own shard, and every rank calls ``restore`` together; see docs/manager.md, "A
            local tier".
        local_keep: how many local steps to keep (None: all).
        remote_every: promote every ``remote_every``-th step.
    """

    local_dir: str | os.PathLike[str]
    local_keep: int | None = 2
    remote_every: int = 1

    def __post_init__(self) -> None:
        normalize_uri(self.local_dir, "local_dir")
        positive_or_none(self.local_keep, "local_keep")
        if positive_or_none(self.remote_every, "remote_every") is None:
            raise TypeError("remote_every must be an int >= 1, not None")


#: Each option value by the constructor's keyword that takes it, with its fields (the older keywords it holds).
GROUPS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    name: (kind, tuple(field.name for field in dataclasses.fields(kind))) for name, kind in (
        ("retention", Retention), ("schedule", Schedule), ("background", BackgroundSaves), ("shards", Shards),
        ("tier", Tier))}


@dataclass(frozen=True)
class Options:
    """The option values of one manager (``tier`` None: no local tier)."""

    retention: Retention
    schedule: Schedule
    background: BackgroundSaves
    shards: Shards
    tier: Tier | None

    @classmethod
    def gather(cls, given: dict[str, Any], older: dict[str, Any]) -> Options:
        """The option values ``given`` (by keyword; None: not given), each one not given made of its fields among
        the ``older`` keywords (a tier only when they name a ``local_dir``, as before the option values).

        A keyword that is no field is a TypeError, as for any function; so is an older keyword beside the option
        value that holds it, naming both (which one was meant cannot be told)."""
        unknown = sorted(set(older).difference(*(names for _, names in GROUPS.values())))
        if unknown:
            raise TypeError(f"CheckpointManager() got an unexpected keyword argument {unknown[0]!r}")
        values: dict[str, Any] = {}
        for name, (kind, names) in GROUPS.items():
            fields = {field: older[field] for field in names if field in older}
            value = given[name]
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} must be a taskpoint.{kind.__name__} or None, not {type(value).__name__}")
            if value is not None and fields:
                raise TypeError(f"{', '.join(f'{field}=' for field in fields)} and {name}= were both given: "
                                f"{kind.__name__} holds {', '.join(fields)}; pass it there, or the keyword alone")
            if value is None and (kind is not Tier or fields.get("local_dir") is not None):
                value = kind(**fields)
            values[name] = value
        return cls(**values)
