"""Streaming tar archives of a directory's top-level entries, and extraction that cannot escape its folder.

Writing walks the tree itself (rather than ``TarFile.add``) so that it can refuse symlinks that leave the
tree and skip sockets and fifos with a warning. Reading checks every member before anything touches the
disk: absolute names, ``..``, links pointing outside, and device or fifo members raise
:class:`~taskpoint.errors.UnsafeArchiveError`; all writes go below the staging folder given by the caller.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
import warnings
from pathlib import Path
from typing import IO

from ..errors import CheckpointCorruptError, UnsafeArchiveError
from ..storage import WRITE_PIECE
from ..storage.streams import read_up_to
from .codecs import BLOCK_SIZE, DECODE_ERRORS, Codec


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


def _inside(root: str, target: str) -> bool:
    return target == root or target.startswith(root + os.sep)


def write_tar(directory: Path, sink: IO[bytes], codec: Codec, level: int | None) -> None:
    """Write ``directory``'s top-level entries, each under its own name, as a ``codec`` archive to ``sink``."""
    root = os.path.realpath(directory)
    stream = codec.writer(sink, level)
    try:
        tar = tarfile.TarFile(
            fileobj=_TellingWriter(stream),  # type: ignore[arg-type]
            mode="w",
            format=tarfile.PAX_FORMAT,
            copybufsize=BLOCK_SIZE,
        )
        with tar:
            for entry in sorted(os.listdir(directory)):
                _add_tree(tar, root, os.path.join(directory, entry), entry)
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to report
            abort = getattr(stream, "abort", None)
            abort() if abort is not None else stream.close()
        raise
    stream.close()


def skip_special(path: str, mode: int, *, stacklevel: int) -> bool:
    """True (with a warning) when ``path`` is a socket, fifo or device, which a checkpoint never holds."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
        return False
    what = "socket" if stat.S_ISSOCK(mode) else "fifo" if stat.S_ISFIFO(mode) else "device"
    warnings.warn(f"taskpoint skipped {what} {path!r}: only files, folders and symlinks are saved",
                  stacklevel=stacklevel)
    return True


def _add_tree(tar: tarfile.TarFile, root: str, path: str, arcname: str) -> None:
    st = os.lstat(path)
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        target = os.readlink(path)
        resolved = os.path.normpath(os.path.join(os.path.dirname(os.path.join(root, arcname)), target))
        if os.path.isabs(target) or not _inside(root, resolved):
            raise ValueError(
                f"symlink {path!r} points outside the directory being saved ({target!r}); a checkpoint "
                "holds only links that stay inside its tree. Replace the link with a copy, or remove it."
            )
    elif skip_special(path, mode, stacklevel=5):
        return
    info = tar.gettarinfo(path, arcname)
    info.uname = info.gname = ""
    if info.isreg():
        with open(path, "rb") as f:
            tar.addfile(info, f)
    else:
        tar.addfile(info)
    if stat.S_ISDIR(mode):
        for entry in sorted(os.listdir(path)):
            _add_tree(tar, root, os.path.join(path, entry), f"{arcname}/{entry}")


class _TarReader:
    """Reads a tar stream member by member, handing regular files' data straight to the caller.

    ``tarfile``'s stream mode copies every byte four to six times on its way through; this reader parses
    headers with ``TarInfo.frombuf`` (checksums included), follows pax (``x``) and GNU long-name (``L``,
    ``K``) records, and moves file data with ``readinto`` into one reused buffer.
    """

    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
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

    def _skip_padding(self, size: int) -> None:
        if size % 512:
            self._exact(512 - size % 512)

    def copy(self, size: int, out: IO[bytes] | None) -> None:
        """Move ``size`` bytes of member data (plus padding) to ``out``, or drop them when ``out`` is None."""
        remaining = size
        while remaining > 0:
            got = self._readinto(self._view[: min(remaining, WRITE_PIECE)])
            if got == 0:
                raise EOFError("the archive ends inside a file")
            if out is not None:
                out.write(self._view[:got])
            remaining -= got
        self._skip_padding(size)

    def next(self) -> tarfile.TarInfo | None:
        """The next member, or None at the end-of-archive marker."""
        pax: dict[str, str] = {}
        long_name = long_link = None
        while True:
            block = self._source.read(512)
            if not block:
                raise EOFError("the archive ends without its end-of-archive marker (truncated)")
            if len(block) < 512:
                block += self._exact(512 - len(block))
            if block == bytes(512):
                return None
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            if info.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
                pax.update(_parse_pax(self._exact(info.size)))
                self._skip_padding(info.size)
            elif info.type == tarfile.XGLTYPE:
                self.copy(info.size, None)
            elif info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
                text = self._exact(info.size).rstrip(b"\0").decode("utf-8", "surrogateescape")
                self._skip_padding(info.size)
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


def extract_tar(source: IO[bytes], staging: Path, uri: str) -> None:
    """Extract the tar stream ``source`` (already decompressed) below ``staging``, refusing unsafe members.

    The stream is read to its end, so that the codec verifies its trailing checksums.
    """
    root = os.path.realpath(staging)
    dir_modes: list[tuple[str, int, float]] = []
    links: list[str] = []
    try:
        reader = _TarReader(source)
        while (member := reader.next()) is not None:
            _extract_member(reader, member, root, uri, dir_modes, links)
        while source.read(BLOCK_SIZE):
            pass
    except (tarfile.TarError, ValueError, *DECODE_ERRORS) as exc:  # type: ignore[misc]
        raise CheckpointCorruptError(
            f"the checkpoint at {uri} is damaged ({type(exc).__name__}: {exc}); it could not be extracted. "
            "Save a new checkpoint, or load an older one."
        ) from exc
    # A link created early can point through a link created later; check where each one ends up now.
    for link in links:
        if not _inside(root, os.path.realpath(link)):
            raise UnsafeArchiveError(f"the checkpoint at {uri} holds a symlink {link!r} that resolves outside "
                                     "the workspace; nothing was extracted")
    for path, mode, mtime in reversed(dir_modes):
        os.chmod(path, mode)
        os.utime(path, (mtime, mtime))


def _unsafe(uri: str, member: tarfile.TarInfo, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"the checkpoint at {uri} holds an unsafe member {member.name!r}: {why}. Nothing is written outside "
        "the workspace; the archive was refused. Only load checkpoints from sources you trust."
    )


def _extract_member(tar: _TarReader, member: tarfile.TarInfo, root: str, uri: str,
                    dir_modes: list[tuple[str, int, float]], links: list[str]) -> None:
    name = member.name
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise _unsafe(uri, member, "absolute path")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _unsafe(uri, member, "'..' in its path")
    if not parts:
        return  # the archive's root folder itself
    if member.ischr() or member.isblk() or member.isfifo() or not (
        member.isreg() or member.isdir() or member.issym() or member.islnk()
    ):
        raise _unsafe(uri, member, "device, fifo or special file")
    target = os.path.join(root, *parts)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    if not _inside(root, os.path.realpath(parent)):
        raise _unsafe(uri, member, "its folder is a link that leads outside")
    if os.path.lexists(target) and not (member.isdir() and os.path.isdir(target)
                                        and not os.path.islink(target)):
        _remove(target)
    if member.isdir():
        os.makedirs(target, exist_ok=True)
        dir_modes.append((target, member.mode & 0o777, member.mtime))
    elif member.issym():
        link = member.linkname
        if os.path.isabs(link) or link.startswith(("/", "\\")):
            raise _unsafe(uri, member, f"symlink to absolute path {link!r}")
        if not _inside(root, os.path.normpath(os.path.join(parent, link))) or not _inside(
            root, os.path.realpath(os.path.join(parent, link))
        ):
            raise _unsafe(uri, member, f"symlink {link!r} leads outside")
        os.symlink(link, target)
        links.append(target)
    elif member.islnk():
        link_parts = [p for p in member.linkname.split("/") if p not in ("", ".")]
        if member.linkname.startswith("/") or ".." in link_parts or not link_parts:
            raise _unsafe(uri, member, f"hard link to {member.linkname!r} outside the archive")
        source = os.path.realpath(os.path.join(root, *link_parts))
        if not _inside(root, source) or not os.path.isfile(source):
            raise _unsafe(uri, member, f"hard link to {member.linkname!r}, which is not a file in the archive")
        os.link(source, target, follow_symlinks=False)
    else:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb", buffering=0) as out:
            tar.copy(member.size, out)
        os.chmod(target, member.mode & 0o777)
        os.utime(target, (member.mtime, member.mtime))


def _remove(path: str) -> None:
    import shutil

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
