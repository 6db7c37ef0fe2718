"""Which rank of a multi-process job this process is, from the variables launchers set.

Read in this order, the first source that sets a rank or a world size wins (it must then set both):

- ``TASKPOINT_RANK``, ``TASKPOINT_WORLD_SIZE`` (and ``TASKPOINT_LOCAL_RANK``): an override;
- torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (under ``srun ... torchrun`` these are the workers'
  ranks, while ``SLURM_PROCID`` numbers the agents: so torchrun's come before Slurm's);
- Slurm's ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``;
- none: rank 0 of 1.

A value that is not an integer, a world size below 1, or a rank outside ``0 .. world_size - 1`` is a
ValueError naming the variable. Only the standard library is used: both the manager and the runtime read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: (rank, world size, local rank) variables of each source, in the order they are read.
SOURCES: tuple[tuple[str, str, str], ...] = (
    ("TASKPOINT_RANK", "TASKPOINT_WORLD_SIZE", "TASKPOINT_LOCAL_RANK"),
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
#: Every variable :func:`ranks_from_environment` reads (for caches keyed on the environment).
RANK_VARIABLES: tuple[str, ...] = tuple(name for source in SOURCES for name in source)
#: Variables that tell one launch of a job from the next, the same for all its ranks: a restarted job
#: (torchrun's restart, a Slurm requeue or new step, a Flyte retry) never reuses a previous launch's values.
INCARNATION_VARIABLES: tuple[str, ...] = (
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT",
    "FLYTE_INTERNAL_EXECUTION_ID", "FLYTE_ATTEMPT_NUMBER", "TASKPOINT_ATTEMPT",
)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: ``rank`` of ``world_size``, ``local_rank`` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0 .. {self.world_size - 1} (world_size {self.world_size}), "
                             f"got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _integer(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None


def ranks_from_environment() -> Ranks:
    """The ranks the launcher's variables describe (see the module's docstring); rank 0 of 1 without any."""
    for rank_name, world_name, local_name in SOURCES:
        rank, world = _integer(rank_name), _integer(world_name)
        if rank is None and world is None:
            continue
        if rank is None or world is None:
            given, missing = (rank_name, world_name) if world is None else (world_name, rank_name)
            raise ValueError(f"${given} is set but ${missing} is not: set both (or neither)")
        local = _integer(local_name)
        try:
            return Ranks(rank, world, 0 if local is None else local)
        except ValueError as exc:
            raise ValueError(f"${rank_name}={rank}, ${world_name}={world}, ${local_name}={local}: {exc}") from None
    return Ranks()


def resolve_ranks(rank: int | None, world_size: int | None) -> Ranks:
    """``rank`` and ``world_size`` as given, each one not given taken from the environment."""
    if rank is not None and world_size is not None:
        return Ranks(rank, world_size)
    found = ranks_from_environment()
    return Ranks(found.rank if rank is None else rank, found.world_size if world_size is None else world_size,
                 found.local_rank)


def incarnation_from_environment() -> str:
    """The launch of the job as the launchers' variables tell it (``""`` when none is set)."""
    return ",".join(f"{name}={os.environ[name].strip()}" for name in INCARNATION_VARIABLES
                    if os.environ.get(name, "").strip())
