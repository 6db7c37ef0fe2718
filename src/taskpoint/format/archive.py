"""Streaming tar archives of a directory's top-level entries: the writer, and the lean reader extraction uses.

Writing walks the tree itself (rather than ``TarFile.add``) so that it can refuse symlinks that leave the
tree and skip sockets and fifos with a warning. The reader hands out members one at a time with bounded
memory whatever the headers claim (:data:`MAX_HEADER_BYTES`); :mod:`.extract` decides what may be created.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..storage import WRITE_PIECE
from ..storage.streams import read_up_to
from .codecs import BLOCK_SIZE, Codec
from .filegzip import DestinationError
from .index import FILE, FOLDER, HARDLINK, SYMLINK, TAR_BLOCK, ArchiveIndex, IndexEntry

#: Most path components a member may have; deeper trees are refused on save and on load.
MAX_DEPTH = 256
#: Longest member path or link target, in bytes (Linux's PATH_MAX).
MAX_PATH_BYTES = 4096
#: Most bytes of pax and GNU long-name records that may precede one member.
MAX_HEADER_BYTES = 1 << 20

class _TellingWriter:
    """Counts bytes written so that ``TarFile`` in plain ``"w"`` mode (large writes, no 10 KiB records)."""

    def __init__(self, sink: IO[bytes]) -> None:
        self._sink = sink
        self._pos = 0

    def write(self, b: bytes) -> int:
        self._sink.write(b)
        n = memoryview(b).nbytes
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass


def link_leaves(parent_depth: int, target: str) -> bool:
    """True when a symlink ``target``, read lexically from a folder ``parent_depth`` levels below the root, leads
    above the root at any point; an empty or absolute target leaves too. The one check of links, on save (a
    source tree, whose walk follows no link) and on load (tar members, folder listings, chunked manifests)."""
    if not target or os.path.isabs(target):
        return True
    depth = parent_depth
    for piece in target.split("/"):
        depth += -1 if piece == ".." else 0 if piece in ("", ".") else 1
        if depth < 0:
            return True
    return False


class _CountingFile:
    """A source file that tells ``on_read`` how many bytes each read returned (a save's progress)."""

    def __init__(self, f: IO[bytes], on_read: Callable[[int], None]) -> None:
        self._f = f
        self._on_read = on_read

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._on_read(len(data))
        return data


def tree_file_bytes(directory: Path) -> int:
    """The bytes of the regular files below ``directory`` (links not followed): what :func:`write_tar` reads."""
    total = 0
    for folder, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):  # gone meanwhile: the save itself reports what it finds
                st = os.lstat(os.path.join(folder, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


@dataclass(frozen=True)
class SourceEntry:
    """One entry below a directory being saved, as :func:`walk_source` found it."""

    #: Where it is on the local disk.
    path: str
    #: Its path below the directory, ``/``-separated (``model/weights.bin``).
    relative: str
    #: Its ``lstat``: links are not followed.
    stat: os.stat_result
    #: Where a symlink points (as written in the link); None for other entries.
    target: str | None = None


def walk_source(directory: str | os.PathLike[str]) -> Iterator[SourceEntry]:
    """Every entry below ``directory`` in sorted order, each folder before what it holds: the one walk of a
    directory being saved (archives and deduplicated steps alike), with the one check of what a checkpoint
    may hold. ValueError for a tree deeper than :data:`MAX_DEPTH` folders or a path longer than
    :data:`MAX_PATH_BYTES` (a load would refuse them), and for a symlink that points outside the directory;
    sockets, fifos and devices are skipped with a warning."""
    def walk(folder: str, prefix: str) -> Iterator[SourceEntry]:
        for name in sorted(os.listdir(folder)):
            path, relative = os.path.join(folder, name), f"{prefix}{name}"
            if relative.count("/") >= MAX_DEPTH or len(os.fsencode(relative)) > MAX_PATH_BYTES:
                raise ValueError(f"{path!r} is nested deeper than {MAX_DEPTH} folders or its path below the saved "
                                 f"directory is longer than {MAX_PATH_BYTES} bytes; a checkpoint cannot hold it (a "
                                 "load would refuse it). Flatten the tree.")
            st = os.lstat(path)
            target = None
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                if link_leaves(relative.count("/"), target):
                    raise ValueError(
                        f"symlink {path!r} points outside the directory being saved ({target!r}); a checkpoint "
                        "holds only links that stay inside its tree. Replace the link with a copy, or remove it.")
            elif skip_special(path, st.st_mode, stacklevel=4):
                continue
            yield SourceEntry(path, relative, st, target)
            if stat.S_ISDIR(st.st_mode):
                yield from walk(path, relative + "/")

    yield from walk(os.fspath(directory), "")


def write_tar(directory: Path, sink: IO[bytes], codec: Codec, level: int | None,
              on_read: Callable[[int], None] | None = None) -> ArchiveIndex | None:
    """Write ``directory``'s top-level entries, each under its own name, as a ``codec`` archive to ``sink``;
    ``on_read(n)`` is told of the bytes read from the files (a save's progress). Returns the archive's index
    (:mod:`.index`), or None when the codec writes no independent members."""
    stream = codec.writer(sink, level)
    entries: list[IndexEntry] = []
    try:
        tar = tarfile.TarFile(
            fileobj=_TellingWriter(stream),  # type: ignore[arg-type]
            mode="w",
            format=tarfile.PAX_FORMAT,
            copybufsize=BLOCK_SIZE,
        )
        with tar:
            for entry in walk_source(directory):
                info = tar.gettarinfo(entry.path, entry.relative)
                info.uname = info.gname = ""
                header = tar.offset
                if info.isreg():
                    with open(entry.path, "rb") as f:
                        tar.addfile(info, f if on_read is None else _CountingFile(f, on_read))
                else:
                    tar.addfile(info)
                size = info.size if info.isreg() else 0
                data = tar.offset - size - (-size % TAR_BLOCK)
                kind = FILE if info.isreg() else FOLDER if info.isdir() else SYMLINK if info.issym() else HARDLINK
                entries.append(IndexEntry(entry.relative, kind, header, data, size,
                                          info.linkname if kind == HARDLINK else ""))
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to report
            abort = getattr(stream, "abort", None)
            abort() if abort is not None else stream.close()
        raise
    stream.close()
    members = codec.members(stream)
    return None if members is None else ArchiveIndex(codec.name, tuple(members), tuple(entries))


def skip_special(path: str, mode: int, *, stacklevel: int) -> bool:
    """True (with a warning) when ``path`` is a socket, fifo or device, which a checkpoint never holds."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
        return False
    what = "socket" if stat.S_ISSOCK(mode) else "fifo" if stat.S_ISFIFO(mode) else "device"
    warnings.warn(f"taskpoint skipped {what} {path!r}: only files, folders and symlinks are saved",
                  stacklevel=stacklevel)
    return True


class _TarReader:
    """Reads a tar stream member by member, handing regular files' data straight to the caller.

    ``tarfile``'s stream mode copies every byte four to six times on its way through; this reader parses
    headers with ``TarInfo.frombuf`` (checksums included), follows pax (``x``) and GNU long-name (``L``,
    ``K``) records, at most :data:`MAX_HEADER_BYTES` of them per member, and hands out file data as views of the
    source's own buffers when it has ``read_view`` (:class:`~taskpoint.storage.streams.OrderedFutureReader`: a
    parallel gzip stream, a subset's members), else read with ``readinto`` into one reused buffer.
    """

    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
        self._read_view: Callable[[int], memoryview] | None = getattr(source, "read_view", None)
        #: The source's ``copy_into(fd, n)`` when it has one (:class:`~.filegzip.FileGzipReader`: member data
        #: written to a file without passing through Python), else None.
        self.copy_into: Callable[[int, int], int] | None = getattr(source, "copy_into", None)
        self._buf = bytearray(BLOCK_SIZE)
        self._view = memoryview(self._buf)

    def _readinto(self, view: memoryview) -> int:
        readinto = getattr(self._source, "readinto", None)
        if readinto is not None:
            return int(readinto(view))
        data = self._source.read(len(view))
        view[: len(data)] = data
        return len(data)

    def _exact(self, n: int) -> bytes:
        data = read_up_to(self._source, n)
        if len(data) < n:
            raise EOFError("the archive ends inside a header or record")
        return data

    def skip_padding(self, size: int) -> None:
        if size % 512:
            self._exact(512 - size % 512)

    def chunk(self, size: int) -> memoryview:
        """The next up to ``size`` bytes of member data (at least one), valid until the next call (it may be a
        buffer that call reuses)."""
        if self._read_view is not None:
            view = self._read_view(min(size, WRITE_PIECE))
        else:
            view = self._view[: self._readinto(self._view[: min(size, WRITE_PIECE)])]
        if not view:
            raise EOFError("the archive ends inside a file")
        return view

    def chunks(self, size: int) -> list[memoryview]:
        """The next up to ``size`` bytes of member data (at least one), at most :data:`WRITE_PIECE`, as one view
        or, from a source with ``read_view``, as several (a stored gzip member's blocks hold 64 KiB each), for
        one ``os.writev``; valid until the next call."""
        views = [self.chunk(size)]
        got = len(views[0])
        while self._read_view is not None and got < min(size, WRITE_PIECE):
            views.append(self.chunk(min(size, WRITE_PIECE) - got))
            got += len(views[-1])
        return views

    def copy_data(self, fd: int, size: int) -> None:
        """Write ``size`` bytes of member data, and skip the padding after them, to the file ``fd``: by the source's
        ``copy_into`` where it has one, else as views for ``os.writev``. DestinationError when writing fails; a
        failure to read passes unchanged."""
        remaining = size
        while remaining > 0 and self.copy_into is not None:
            copied = self.copy_into(fd, remaining)
            if not copied:
                raise EOFError("the archive ends inside a file")
            remaining -= copied
        while remaining > 0:
            views = self.chunks(remaining)
            remaining -= sum(map(len, views))
            try:
                while views:
                    written = os.writev(fd, views)
                    while views and written >= len(views[0]):
                        written -= len(views.pop(0))
                    if written:
                        views[0] = views[0][written:]
            except OSError as exc:
                raise DestinationError(exc) from exc
        self.skip_padding(size)

    def skip(self, size: int) -> None:
        """Drop ``size`` bytes of member data, and the padding after them."""
        remaining = size
        while remaining > 0:
            remaining -= len(self.chunk(remaining))
        self.skip_padding(size)

    def next(self) -> tarfile.TarInfo | None:
        """The next member, or None at the end-of-archive marker."""
        pax: dict[str, str] = {}
        long_name = long_link = None
        extended = 0
        while True:
            block = self._source.read(512)
            if not block:
                raise EOFError("the archive ends without its end-of-archive marker (truncated)")
            if len(block) < 512:
                block += self._exact(512 - len(block))
            if block == bytes(512):
                return None
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            if info.size < 0:
                raise tarfile.ReadError(f"member {info.name!r} has a negative size")
            if info.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.XGLTYPE,
                             tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
                extended += info.size
                if extended > MAX_HEADER_BYTES:
                    raise tarfile.ReadError(f"more than {MAX_HEADER_BYTES} bytes of extended headers before "
                                            "one member")
            if info.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
                pax.update(_parse_pax(self._exact(info.size)))
                self.skip_padding(info.size)
            elif info.type == tarfile.XGLTYPE:
                self.skip(info.size)
            elif info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
                text = self._exact(info.size).rstrip(b"\0").decode("utf-8", "surrogateescape")
                self.skip_padding(info.size)
                if info.type == tarfile.GNUTYPE_LONGNAME:
                    long_name = text
                else:
                    long_link = text
            elif info.type == tarfile.GNUTYPE_SPARSE or "GNU.sparse.major" in pax:
                raise tarfile.ReadError(f"sparse member {info.name!r} is not supported")
            else:
                info.name = pax.get("path", long_name or info.name)
                info.linkname = pax.get("linkpath", long_link or info.linkname)
                if "size" in pax:
                    info.size = int(pax["size"])
                    if info.size < 0:
                        raise tarfile.ReadError(f"member {info.name!r} has a negative size")
                if "mtime" in pax:
                    info.mtime = float(pax["mtime"])
                if info.isdir():
                    info.name = info.name.rstrip("/")
                return info


def _parse_pax(data: bytes) -> dict[str, str]:
    """Records ``"%d %s=%s\\n"`` of a pax extended header."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        if length <= 0:
            raise tarfile.ReadError("invalid pax record length")
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out
