"""The storage layer: where bytes live, and everything that can go wrong on the way there.

Owns: :class:`Location` (a URI as a value object), the client and backend chosen for it (``clients``), the
retry policy, the typed error map that turns each client's exceptions into :mod:`taskpoint.errors`' storage
errors, one backend per kind of store (local disk, S3, other object stores, write-then-move), S3 multipart
uploads (``_s3``), the obstore fast path for S3 (``_obstore``), kernel copies and fsync on local disk
(``_localio``), and stream helpers (``streams``).

May import: the standard library, fsspec, and :mod:`taskpoint.errors`; the stores' clients (s3fs, obstore,
...) only where used, never at import. Nothing here knows what a checkpoint, a payload or an archive is.
"""

from .._log import safe_uri
from ._localio import (
    WRITE_PIECE,
    ParallelCopy,
    copy_fd_in_kernel,
    copy_with_metadata,
    digest_by_reading,
    digest_of_fd,
)
from .backends import LEFTOVER_GRACE_SECONDS, Kind, WriteHooks, modified_time
from .deadline import NO_DEADLINE, Deadline, bounded
from .errormap import Failure, classify, is_transient, map_errors
from .location import Location, normalize_uri
from .retry import RetryPolicy
from .streams import VersionConflict
from .uris import check_uri

__all__ = [
    "LEFTOVER_GRACE_SECONDS",
    "NO_DEADLINE",
    "WRITE_PIECE",
    "Deadline",
    "Failure",
    "Kind",
    "Location",
    "ParallelCopy",
    "RetryPolicy",
    "VersionConflict",
    "WriteHooks",
    "bounded",
    "check_uri",
    "classify",
    "copy_fd_in_kernel",
    "copy_with_metadata",
    "digest_by_reading",
    "digest_of_fd",
    "is_transient",
    "map_errors",
    "modified_time",
    "normalize_uri",
    "safe_uri",
]
