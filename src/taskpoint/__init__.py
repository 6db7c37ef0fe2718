"""taskpoint: checkpoints for long-running, retried tasks.

Save progress to any fsspec location (local disk, ``memory://``, ``s3://``, ``gs://``, ``az://``) and pick it
up on the next attempt::

    cp = taskpoint.Checkpoint("s3://bucket/run/1/ckpt", "s3://bucket/run/0/ckpt")
    state = cp.load_sync()          # None on the first attempt
    cp.save_sync(b"step=42")
"""

from ._checkpoint import BaseCheckpoint, Checkpoint
from ._context import TaskContext, ctx
from ._latest import latest_checkpoint
from ._manager import CheckpointManager
from ._repair import repair_prev_checkpoint_uri
from ._runtime import task
from ._storage import RetryPolicy
from .errors import CheckpointCorruptError, CheckpointError, StorageError, UnsafeArchiveError

__all__ = [
    "BaseCheckpoint",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "RetryPolicy",
    "StorageError",
    "TaskContext",
    "UnsafeArchiveError",
    "ctx",
    "latest_checkpoint",
    "repair_prev_checkpoint_uri",
    "task",
]

__version__ = "0.1.0"
