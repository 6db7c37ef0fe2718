"""An archived payload extracted into a staging folder, where the caller publishes it once its digest is checked.

From a stream (:func:`extract_stream`: any store, each byte hashed as it is read), or, for a manager step on local
disk, from the stored file itself (:func:`extract_file`): a thread hashes the file by positional reads while the
extraction reads the archive by offset and the kernel copies the data of stored gzip members to the files it writes
(:class:`~taskpoint.format.filegzip.FileGzipReader`), and the digest is checked before it returns. That spares
copying every stored byte into Python and back out, and the hash copies each piece into one small buffer that stays
in the CPU's cache: see docs/performance.md, "Where the time goes".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from ._progress import Progress
from .digests import DIGESTS
from .errors import CheckpointCorruptError
from .executors import CPU
from .format.codecs import detect_codec
from .payloads import Payload
from .storage import digest_by_reading

#: Checks the streamed object (payload kind, size, hex digest); raises when it does not match.
Verifier = Callable[[str, int, str], None]


def extract_stream(cls: type[Payload], source: IO[bytes], head: bytes, staging: Path, uri: str,
                   max_expand: int | None, only: Sequence[str] | None, judge: Callable[[], None] | None) -> None:
    """Extract the archive ``source`` streams (its first bytes ``head`` not yet consumed) below ``staging``. With
    ``judge`` (which reads the rest of the stream and checks its digest: a manager step's), the codec leaves checks
    of the stored bytes to the digest (stored gzip members skip their CRC32), so damage may reach the archive's
    reader and read as another refusal (a bad tar header, an unsafe or missing name): then ``judge`` runs first,
    and names damage as such (for pieces, which piece), in the same read."""
    stream = detect_codec(head, uri).reader(source, head, hashed=judge is not None)
    _materialize(cls, stream, staging, uri, max_expand, only, judge)


def extract_file(cls: type[Payload], fd: int, size: int, head: bytes, staging: Path, uri: str,
                 max_expand: int | None, only: Sequence[str] | None, digest: str, verify: Verifier,
                 progress: Progress) -> bool:
    """Extract the archive in the first ``size`` bytes of the open local file ``fd`` below ``staging`` while a
    thread hashes those bytes by ``digest`` (a cryptographic one, which ``verify`` checks); False, with nothing
    done, when its codec cannot read a file so. ``verify`` has accepted the bytes hashed when this returns, and
    judges them first when the extraction finds the archive damaged. The hash and the extraction read the same open
    file, whose inode saves never write into (they replace it by rename); one truncated meanwhile fails the size
    check, or the extraction with EOFError."""
    stream = detect_codec(head, uri).file_reader(fd, size, head)
    if stream is None:
        return False
    hasher = DIGESTS[digest]()
    with CPU.lane(1) as lane:
        hashing = lane.submit(digest_by_reading, fd, size, hasher, progress.update if progress.active else None)

        def judge() -> None:
            verify(cls.kind, hashing.result(), str(hasher.hexdigest()))

        _materialize(cls, stream, staging, uri, max_expand, only, judge)
        judge()
    return True


def _materialize(cls: type[Payload], stream: IO[bytes], staging: Path, uri: str, max_expand: int | None,
                 only: Sequence[str] | None, judge: Callable[[], None] | None) -> None:
    try:
        extra = {} if only is None else {"only": only}
        cls.materialize(stream, staging, uri, max_expand=max_expand, **extra)  # type: ignore[call-arg]
    except (CheckpointCorruptError, KeyError):
        if judge is not None:
            stream.close()  # the gzip reader's cutter stops at a member's boundary: the digest reads on from there
            judge()
        raise
    finally:
        stream.close()
