"""taskpoint: checkpoints for long-running, retried tasks.

Save progress to any fsspec location (local disk, ``memory://``, ``s3://``, ``gs://``, ``az://``) and pick it
up on the next attempt::

    cp = taskpoint.Checkpoint("s3://bucket/run/1/ckpt", "s3://bucket/run/0/ckpt")
    state = cp.load_sync()          # None on the first attempt
    cp.save_sync(b"step=42")

This module holds the public names only; docs/design.md describes the layers behind them.
"""

from ._log import TransferStats
from .checkpoint import BaseCheckpoint, Checkpoint
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    NewerFormatError,
    Preempted,
    RestoreMismatch,
    RestoreReport,
    SaveStalledError,
    StepAbandonedError,
    StorageAccessDenied,
    StorageError,
    StorageFull,
    StorageNotFound,
    StorageUnavailable,
    UnsafeArchiveError,
)
from .inspection import checkpoints_in
from .latest import latest_checkpoint
from .manager import (
    BackgroundSaves,
    CheckpointManager,
    KeepBest,
    Retention,
    Schedule,
    Shards,
    StepDescription,
    StepSummary,
    StepVerification,
    Tier,
    Verification,
    set_attempt_source,
)
from .runtime import TaskContext, ctx, repair_prev_checkpoint_uri, running_attempt, task
from .storage import RetryPolicy

# The composition root: the manager records the attempt that saved each step, but its layer lies below the
# runtime's and may not import it; the runtime's lookup is handed to it here, where both are imported.
set_attempt_source(running_attempt)

__all__ = [
    "BackgroundSaves",
    "BaseCheckpoint",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "KeepBest",
    "NewerFormatError",
    "Preempted",
    "RestoreMismatch",
    "RestoreReport",
    "Retention",
    "RetryPolicy",
    "SaveStalledError",
    "Schedule",
    "Shards",
    "StepAbandonedError",
    "StepDescription",
    "StepSummary",
    "StepVerification",
    "StorageAccessDenied",
    "StorageError",
    "StorageFull",
    "StorageNotFound",
    "StorageUnavailable",
    "TaskContext",
    "Tier",
    "TransferStats",
    "UnsafeArchiveError",
    "Verification",
    "checkpoints_in",
    "ctx",
    "latest_checkpoint",
    "repair_prev_checkpoint_uri",
    "task",
]

__version__ = "0.1.0"
