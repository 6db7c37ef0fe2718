"""The storage layer: where bytes live, and everything that can go wrong on the way there.

Owns: :class:`Location` (a URI as a value object), the client and backend chosen for it (``clients``), the
retry policy, the typed error map that turns each client's exceptions into :mod:`taskpoint.errors`' storage
errors, one backend per kind of store (local disk, S3, other object stores, write-then-move), S3 multipart
uploads (``_s3``), the obstore fast path for S3 (``_obstore``), kernel copies and fsync on local disk
(``localio``), and stream helpers (``streams``).

Exports what an extension (``taskpoint.jax``, ``taskpoint.torch``, a step kind of another package) and the command
line need: :class:`Location`, :class:`RetryPolicy`, :class:`Deadline`, the URI helpers, and the local file I/O a
step kind's own files use. The rest of taskpoint imports the other names from the modules that hold them.

May import: the standard library, fsspec, and :mod:`taskpoint.errors`; the stores' clients (s3fs, obstore,
...) only where used, never at import. Nothing here knows what a checkpoint, a payload or an archive is.
"""

from .._log import safe_uri
from .deadline import Deadline
from .localio import WRITE_PIECE, copy_fd_in_kernel, digest_by_reading
from .location import Location, normalize_uri
from .retry import RetryPolicy
from .uris import check_uri

__all__ = ["WRITE_PIECE", "Deadline", "Location", "RetryPolicy", "check_uri", "copy_fd_in_kernel",
           "digest_by_reading", "normalize_uri", "safe_uri"]
