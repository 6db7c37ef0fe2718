"""Hostile archives and damaged checkpoints: each is refused with the right error or loaded safely.

Every hostile archive is built here, byte by byte where needed, with :mod:`tarfile`, :mod:`gzip` and
:mod:`zlib`, stored with and without a record beside it (a forged record that matches the hostile bytes, so
only the archive checks stand between it and the disk) and loaded with ``Checkpoint(dest, src).load_sync()``.
A sentinel folder beside the workspace, and everything else outside the workspace, is snapshotted before
and after each load: 0 writes outside the workspace, folders included. Memory is measured as the peak RSS
of a loader subprocess. The damage test flips bits in and truncates stored objects and records with a
seeded RNG: every damage is detected.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import textwrap
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import zstandard

import taskpoint.format.extract as archive
from helpers import fast_counting, make_tree, mounted_tmpfs, snapshot, write_object
from taskpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointError,
    StorageFull,
    UnsafeArchiveError,
)
from taskpoint.format.pgzip import MEMBER_SIZE, member
from taskpoint.format.records import ObjectRecord, Record

T = TypeVar("T")



# -- building archives -------------------------------------------------------------------------------------

Entry = tuple[tarfile.TarInfo, "bytes | None"]


def entry(name: str, kind: bytes = tarfile.REGTYPE, *, link: str = "", mode: int = 0o644,
          pax: dict[str, str] | None = None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime = kind, link, mode, 1_700_000_000
    if pax:
        info.pax_headers = dict(pax)
    return info


def tar(entries: list[Entry], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """An uncompressed tar of ``entries``, written by tarfile (end marker and record padding included)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape") as t:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def labelled(data: bytes) -> bytes:
    """``data`` as taskpoint's labelled gzip members (what a save writes)."""
    return b"".join(member(data[i:i + MEMBER_SIZE], 1) for i in range(0, max(len(data), 1), MEMBER_SIZE))


CODECS = {
    "gzip": lambda data: gzip.compress(data, 6, mtime=0),  # a plain gzip stream, as Flyte or tar czf write
    "labelled": labelled,
    "zstd": lambda data: zstandard.ZstdCompressor(write_checksum=True).compress(data),
    "none": lambda data: data,
}
RECORD_CODEC = {"gzip": "gzip", "labelled": "gzip", "zstd": "zstd", "none": "none"}


def compressed(entries: list[Entry], codec: str = "gzip", fmt: int = tarfile.PAX_FORMAT) -> bytes:
    return CODECS[codec](tar(entries, fmt))


def record_for(blob: bytes, kind: str = "directory", codec: str = "gzip") -> bytes:
    """A committed record that matches ``blob`` exactly (a forged one, for a hostile archive)."""
    return Record(objects=(ObjectRecord(kind=kind, codec=codec, save_id=uuid.uuid4().hex, created=time.time(),
                                        size=len(blob), crc32=f"{zlib.crc32(blob):08x}"),)).to_bytes()


def zeros_stream(size: int, *, name: str = "zeros.bin") -> Iterator[bytes]:
    """A tar holding one file of ``size`` zero bytes, produced in pieces (never whole in memory)."""
    info = entry(name)
    info.size = size
    yield info.tobuf(tarfile.PAX_FORMAT)
    piece = bytes(1 << 20)
    for _ in range(size >> 20):
        yield piece
    yield bytes(size & ((1 << 20) - 1))
    yield bytes(-size % 512 + 1024)  # padding, end-of-archive marker


def zeros_bomb(size: int, codec: str) -> bytes:
    """A compressed tar expanding to ``size`` bytes of zeros, built in pieces."""
    if codec == "gzip":
        z = zlib.compressobj(9, zlib.DEFLATED, 31)
        return b"".join([*(z.compress(p) for p in zeros_stream(size)), z.flush()])
    if codec == "zstd":
        c = zstandard.ZstdCompressor(level=3, write_checksum=True).compressobj()
        return b"".join([*(c.compress(p) for p in zeros_stream(size)), c.flush()])
    assert codec == "labelled"
    out, pending = [], b""
    for piece in zeros_stream(size):
        pending += piece
        while len(pending) >= MEMBER_SIZE:
            out.append(member(pending[:MEMBER_SIZE], 1))
            pending = pending[MEMBER_SIZE:]
    out.append(member(pending, 1))
    return b"".join(out)


def lying_member(size: int, isize: int, *, label: int | None = None) -> bytes:
    """One taskpoint-labelled gzip member whose deflate data inflates to a tar of ``size`` zero bytes, but
    whose trailer says ``isize`` bytes (and whose label says ``label`` bytes, when given)."""
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    crc, body = 0, []
    for piece in zeros_stream(size):
        crc = zlib.crc32(piece, crc)
        body.append(z.compress(piece))
    body.append(z.flush())
    deflated = b"".join(body)
    layout = "<2sBBIBBH2sHI"  # RFC 1952 header with one extra subfield, "TP", holding the member's length
    total = struct.calcsize(layout) + len(deflated) + 8
    header = struct.pack(layout, b"\x1f\x8b", 8, 4, 0, 0, 255, 8, b"TP", 4, total if label is None else label)
    return header + deflated + struct.pack("<II", crc, isize & 0xFFFFFFFF)


# -- loading them, and proving nothing outside the workspace changed ------------------------------------------


def tree_state(root: Path, skip: Path) -> dict[str, tuple[int, int, int]]:
    """Every path below ``root`` except ``skip`` and what is below it: mode, size, mtime (links not followed)."""
    out: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == skip.parent:
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@dataclass
class Arena:
    """A store folder, a workspace, and a sentinel folder that no load may touch, all below ``root``."""

    root: Path

    def __post_init__(self) -> None:
        self.store = self.root / "store"
        self.ws = self.root / "ws"
        self.sentinel = self.root / "sentinel"
        for folder in (self.store, self.ws, self.sentinel / "victim"):
            folder.mkdir(parents=True)
        (self.sentinel / "victim" / "keep.txt").write_text("untouched")

    @property
    def staging_depth(self) -> int:
        """How many folders lie above the staging folder a load extracts into (``ws/.taskpoint-staging-*``)."""
        return len(Path(os.path.realpath(self.ws)).parts)

    def load(self, blob: bytes, *, record: bool, codec: str = "gzip", kind: str = "directory") -> Path | None:
        """Store ``blob`` (with a matching record when ``record``) and load it into the workspace; on failure
        the workspace must be empty; either way nothing outside it may change."""
        src = self.store / "ckpt"
        src.write_bytes(blob)
        rec = self.store / "ckpt.taskpoint.json"
        if record:
            rec.write_bytes(record_for(blob, kind, RECORD_CODEC.get(codec, codec)))
        elif rec.exists():
            rec.unlink()
        shutil.rmtree(self.ws)
        self.ws.mkdir()
        before = tree_state(self.root, self.ws)
        try:
            with Checkpoint(self.root / "dest", src, workspace=self.ws) as cp:
                return cp.load_sync()
        except BaseException:
            assert os.listdir(self.ws) == [], "a refused load left something in the workspace"
            raise
        finally:
            assert tree_state(self.root, self.ws) == before, "a load wrote outside its workspace"
            assert not os.path.lexists("/EVIL") and not os.path.lexists("/tmp/EVIL")


@pytest.fixture
def arena(tmp_path: Path) -> Arena:
    return Arena(tmp_path)


# -- refused: paths, links, special files ---------------------------------------------------------------------


def _chain_13(arena: Arena) -> list[Entry]:
    """Issue 11, item 13: ``a -> x/x/.../x/../../..`` (inside while ``x`` does not exist), then ``x -> .``, so
    that ``a`` becomes ``/``, then a member below ``a`` naming the sentinel folder."""
    n = arena.staging_depth
    victim = str(arena.sentinel / "victim").lstrip("/")
    return [
        (entry("a", tarfile.SYMTYPE, link="/".join(["x"] * n + [".."] * n)), None),
        (entry("x", tarfile.SYMTYPE, link="."), None),
        (entry(f"a/{victim}/EVIL/sub/f"), b"pwned"),
    ]


def _hostile(arena: Arena) -> dict[str, list[Entry]]:
    outside = str(arena.sentinel / "abs-escape.txt")
    return {
        "absolute-path": [(entry(outside), b"pwned")],
        "absolute-dir": [(entry(str(arena.sentinel / "EVIL"), tarfile.DIRTYPE, mode=0o755), None)],
        "dot-dot": [(entry("../escape.txt"), b"pwned")],
        "dot-dot-nested": [(entry("a/b/../../../escape.txt"), b"pwned")],
        "symlink-absolute": [(entry("link", tarfile.SYMTYPE, link=str(arena.sentinel)), None)],
        "symlink-escape": [(entry("link", tarfile.SYMTYPE, link="../../sentinel"), None)],
        "symlink-then-file-through-it": [
            (entry("d", tarfile.DIRTYPE, mode=0o755), None),
            (entry("d/up", tarfile.SYMTYPE, link=".."), None),
            (entry("d/up/up2", tarfile.SYMTYPE, link=".."), None),
            (entry("d/up/up2/escape.txt"), b"pwned"),
        ],
        "symlink-inside-then-file-through-it": [
            (entry("real", tarfile.DIRTYPE, mode=0o755), None),
            (entry("alias", tarfile.SYMTYPE, link="real"), None),
            (entry("alias/f.txt"), b"through a link"),
        ],
        "symlink-then-folder-through-it": [
            (entry("up", tarfile.SYMTYPE, link="."), None),
            (entry("up/EVIL", tarfile.DIRTYPE, mode=0o755), None),
        ],
        "item-13-link-chain": _chain_13(arena),
        "symlink-chain-resolved-late": [
            (entry("x", tarfile.SYMTYPE, link="d/l/.."), None),
            (entry("d", tarfile.DIRTYPE, mode=0o755), None),
            (entry("d/l", tarfile.SYMTYPE, link=".."), None),
        ],
        "symlink-loop": [
            (entry("p", tarfile.SYMTYPE, link="q"), None),
            (entry("q", tarfile.SYMTYPE, link="p"), None),
        ],
        "hardlink-escape": [(entry("h", tarfile.LNKTYPE, link="../../sentinel/victim/keep.txt"), None)],
        "hardlink-absolute": [(entry("h", tarfile.LNKTYPE, link=str(arena.sentinel / "victim" / "keep.txt")), None)],
        "hardlink-through-symlink": [
            (entry("out", tarfile.SYMTYPE, link="."), None),
            (entry("f.txt"), b"data"),
            (entry("h", tarfile.LNKTYPE, link="out/f.txt"), None),
        ],
        "hardlink-to-folder": [(entry("d", tarfile.DIRTYPE, mode=0o755), None),
                               (entry("h", tarfile.LNKTYPE, link="d"), None)],
        "char-device": [(entry("dev", tarfile.CHRTYPE), None)],
        "block-device": [(entry("blk", tarfile.BLKTYPE), None)],
        "fifo": [(entry("fifo", tarfile.FIFOTYPE), None)],
        "pax-path-override": [(entry("innocent.txt", pax={"path": "../pax-escape.txt"}), b"pwned")],
        "pax-absolute-override": [(entry("innocent.txt", pax={"path": outside}), b"pwned")],
        "pax-linkpath-override": [(entry("l", tarfile.SYMTYPE, link="ok", pax={"linkpath": str(arena.sentinel)}),
                                   None)],
        "root-as-file": [(entry("."), b"not a folder")],
        "too-deep-path": [(entry("/".join(["d"] * 1000) + "/f", pax={}), b"deep")],
    }


GNU_HOSTILE = {
    "gnu-longname-dot-dot": [(entry("a" * 120 + "/../../gnu-escape.txt"), b"pwned")],
    "gnu-longlink-absolute": [(entry("l", tarfile.SYMTYPE, link="/" + "x" * 150), None)],
}


HOSTILE_CASES = [
    "absolute-path", "absolute-dir", "dot-dot", "dot-dot-nested", "symlink-absolute",
    "symlink-escape", "symlink-then-file-through-it", "symlink-inside-then-file-through-it",
    "symlink-then-folder-through-it", "item-13-link-chain", "symlink-chain-resolved-late", "symlink-loop",
    "hardlink-escape", "hardlink-absolute", "hardlink-through-symlink", "hardlink-to-folder", "char-device",
    "block-device", "fifo", "pax-path-override", "pax-absolute-override", "pax-linkpath-override",
    "root-as-file", "too-deep-path",
]


def test_every_hostile_case_is_run(arena):
    assert sorted(HOSTILE_CASES) == sorted(_hostile(arena))


@pytest.mark.parametrize("record", [False, True], ids=["no-record", "forged-record"])
@pytest.mark.parametrize("case", HOSTILE_CASES)
def test_hostile_archive_is_refused_and_nothing_is_written_outside(arena, case, record):
    members = [(entry("ok.txt"), b"fine"), *_hostile(arena)[case]]
    with pytest.raises(UnsafeArchiveError):
        arena.load(compressed(members), record=record)
    assert not (arena.sentinel / "victim" / "EVIL").exists()


def test_backslashes_and_drive_letters_are_parts_of_posix_names_and_escape_nothing(arena):
    """On POSIX only "/" separates: "a\\..\\..\\x" and "C:x" are single names, loaded as they are (the campaign's
    round trips found names with a backslash split into folders)."""
    names = ["a\\..\\..\\escape.txt", "back\\slash", "C:drive.txt", "d/e\\f"]
    members = [(entry("d", tarfile.DIRTYPE, mode=0o755), None), *((entry(n), n.encode()) for n in names)]
    loaded = arena.load(compressed(members), record=False)
    for name in names:
        assert (loaded / name).read_bytes() == name.encode()
    expected = ["C:drive.txt", "a\\..\\..\\escape.txt", "back\\slash", "d"]
    assert sorted(p.name for p in loaded.iterdir()) == sorted(expected)


@pytest.mark.parametrize("case", sorted(GNU_HOSTILE))
def test_gnu_long_name_overrides_are_checked_like_any_name(arena, case):
    with pytest.raises(UnsafeArchiveError):
        arena.load(compressed([(entry("ok.txt"), b"fine"), *GNU_HOSTILE[case]], fmt=tarfile.GNU_FORMAT),
                   record=True)


def test_the_item_13_chain_creates_no_folder_outside_and_is_not_retried(arena):
    """The exact shape of the report: before the fix, ``sentinel/victim/EVIL/sub`` was created."""
    blob = compressed(_chain_13(arena))
    (arena.store / "ckpt").write_bytes(blob)
    retry = fast_counting()
    with pytest.raises(UnsafeArchiveError, match="symlink 'a'"):
        Checkpoint(arena.root / "dest", arena.store / "ckpt", workspace=arena.ws, retry=retry).load_sync()
    assert retry.runs.count("load the checkpoint from") == 1
    assert sorted(os.listdir(arena.sentinel / "victim")) == ["keep.txt"]


def test_a_1000_level_path_is_refused_at_once_not_a_recursion_error(arena):
    (arena.store / "ckpt").write_bytes(compressed([(entry("/".join(["d"] * 1000) + "/f"), b"x")]))
    retry = fast_counting()
    with pytest.raises(UnsafeArchiveError, match="deeper than 256"):
        Checkpoint(arena.root / "dest", arena.store / "ckpt", workspace=arena.ws, retry=retry).load_sync()
    assert retry.runs.count("load the checkpoint from") == 1


def test_a_tree_too_deep_to_load_is_refused_at_save(tmp_path):
    deep = tmp_path / "tree"
    os.makedirs(os.path.join(deep, *["d"] * 300))
    with pytest.raises(ValueError, match="deeper than 256"):
        Checkpoint(tmp_path / "ckpt").save_sync(deep)


# -- loaded safely --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("record", [False, True], ids=["no-record", "forged-record"])
def test_setuid_setgid_and_sticky_bits_are_stripped(arena, record):
    loaded = arena.load(compressed([
        (entry("suid", mode=0o4755), b"#!/bin/sh\n"),
        (entry("sgid", mode=0o2750), b"x"),
        (entry("shared", tarfile.DIRTYPE, mode=0o3777), None),
    ]), record=record)
    assert stat.S_IMODE(os.stat(loaded / "suid").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(loaded / "sgid").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(loaded / "shared").st_mode) == 0o777


@pytest.mark.parametrize("record", [False, True], ids=["no-record", "forged-record"])
def test_duplicate_names_the_last_one_wins_and_nothing_goes_through_a_replaced_link(arena, record):
    loaded = arena.load(compressed([
        (entry("a.txt"), b"first"),
        (entry("a.txt"), b"second"),
        (entry("d", tarfile.DIRTYPE, mode=0o755), None),
        (entry("d/inner.txt"), b"inner"),
        (entry("d"), b"now a file"),
        (entry("s", tarfile.SYMTYPE, link="d"), None),
        (entry("s", tarfile.DIRTYPE, mode=0o755), None),  # the link is replaced by a real folder
        (entry("s/f.txt"), b"in the real folder"),
        (entry("f.txt"), b"a file"),
        (entry("f.txt", tarfile.SYMTYPE, link="a.txt"), None),
        (entry("h", tarfile.LNKTYPE, link="a.txt"), None),
        (entry("a.txt"), b"third"),  # replaced, not written through the hard link
    ]), record=record)
    assert (loaded / "a.txt").read_bytes() == b"third"
    assert (loaded / "h").read_bytes() == b"second"
    assert (loaded / "d").read_bytes() == b"now a file"
    assert not (loaded / "s").is_symlink() and (loaded / "s" / "f.txt").read_bytes() == b"in the real folder"
    assert os.readlink(loaded / "f.txt") == "a.txt"


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_non_utf8_names_load_as_their_bytes(arena, fmt):
    name = b"caf\xe9-\xff.bin".decode("utf-8", "surrogateescape")
    loaded = arena.load(compressed([(entry(name), b"bytes"), (entry("ok.txt"), b"fine")], fmt=fmt), record=True)
    assert sorted(os.listdir(os.fsencode(loaded))) == [b"caf\xe9-\xff.bin", b"ok.txt"]
    assert (loaded / name).read_bytes() == b"bytes"


def test_safe_links_inside_and_long_names_load(arena):
    long_name = "/".join(["n" * 100] * 3) + "/f.txt"
    loaded = arena.load(compressed([
        (entry("d", tarfile.DIRTYPE, mode=0o750), None),
        (entry("d/f.txt"), b"data"),
        (entry("d/self", tarfile.SYMTYPE, link="."), None),
        (entry("top", tarfile.SYMTYPE, link="d/self/f.txt"), None),
        (entry("hard", tarfile.LNKTYPE, link="d/f.txt"), None),
        (entry(long_name), b"long"),
    ], fmt=tarfile.GNU_FORMAT), record=True)
    assert (loaded / "top").read_bytes() == b"data"
    assert os.stat(loaded / "hard").st_ino == os.stat(loaded / "d" / "f.txt").st_ino
    assert (loaded / long_name).read_bytes() == b"long"
    assert stat.S_IMODE(os.stat(loaded / "d").st_mode) == 0o750


# -- damaged streams ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("record", [False, True], ids=["no-record", "forged-record"])
@pytest.mark.parametrize("codec", ["gzip", "labelled", "zstd", "none"])
def test_trailing_garbage_inside_the_stream_is_corrupt(arena, codec, record):
    blob = CODECS[codec](tar([(entry("ok.txt"), b"fine")]) + b"trailing garbage")
    with pytest.raises(CheckpointCorruptError, match="end-of-archive"):
        arena.load(blob, record=record, codec=codec)


@pytest.mark.parametrize("record", [False, True], ids=["no-record", "forged-record"])
@pytest.mark.parametrize("codec", ["gzip", "labelled", "zstd"])
def test_trailing_garbage_after_the_compressed_stream_is_corrupt(arena, codec, record):
    blob = CODECS[codec](tar([(entry("ok.txt"), b"fine")])) + b"\x00garbage after the stream" * 10
    with pytest.raises(CheckpointCorruptError):
        arena.load(blob, record=record, codec=codec)


@pytest.mark.parametrize("record", [False, True], ids=["no-record", "forged-record"])
@pytest.mark.parametrize("codec", ["gzip", "labelled", "zstd", "none"])
def test_truncated_streams_are_corrupt_or_load_whole(arena, codec, record):
    files = [(entry("a.bin"), random.Random(1).randbytes(300_000)), (entry("b.txt"), b"tail")]
    data = tar(files)
    whole = CODECS[codec](data)
    # Cut inside the tar's content, and a whole codec stream of a tar cut before its end-of-archive marker.
    for blob in (whole[: len(whole) // 2], whole[: len(whole) * 9 // 10],
                 CODECS[codec](data.rstrip(b"\0") + bytes(-len(data.rstrip(b"\0")) % 512))):
        with pytest.raises(CheckpointCorruptError):
            arena.load(blob, record=record, codec=codec)
    # Cut inside the codec's own trailer: gzip's CRC32 and length say so; a zstd frame's checksum (which
    # zstandard's stream reader does not insist on) and a plain tar's padding leave the files whole, so those
    # may load, but only with every file complete.
    for cut in (1, 4):
        if codec in ("gzip", "labelled"):
            with pytest.raises(CheckpointCorruptError):
                arena.load(whole[:-cut], record=record, codec=codec)
            continue
        try:
            loaded = arena.load(whole[:-cut], record=record, codec=codec)
        except CheckpointCorruptError:
            continue
        assert loaded is not None
        assert {p.name: p.read_bytes() for p in loaded.iterdir()} == {i.name: d for i, d in files}


def test_oversized_extended_headers_are_refused_without_reading_them(arena):
    info = entry("x", tarfile.XHDTYPE)
    info.size = 1 << 32  # a pax header claiming 4 GiB
    blob = gzip.compress(info.tobuf(tarfile.USTAR_FORMAT) + bytes(4096))
    with pytest.raises(CheckpointCorruptError, match="extended headers"):
        arena.load(blob, record=True)


# -- resource bombs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["gzip", "labelled", "zstd"])
def test_a_bomb_beyond_max_expand_stops_with_storage_full(arena, codec, monkeypatch):
    monkeypatch.setattr(archive, "MAX_EXPAND", 8 << 20)
    with pytest.raises(StorageFull, match="max_expand=8388608") as info:
        arena.load(zeros_bomb(64 << 20, codec), record=True, codec=codec)
    assert info.value.__cause__ is None  # stopped by the limit, not by a failed write


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_max_expand_of_a_checkpoint_limits_its_loads(store, tmp_path):
    """``Checkpoint(max_expand=N)``: a directory or a file that would expand past N bytes stops with StorageFull
    before writing past it; the same checkpoint loads under a larger limit; wrong
    values are refused when the Checkpoint is made."""
    opts, base = store.storage_options, store.url("stored")
    tree = make_tree(tmp_path / "tree", big=300_000)
    total = sum(f.stat().st_size for f in tree.rglob("*") if f.is_file() and not f.is_symlink())
    Checkpoint(f"{base}/dir", storage_options=opts).save_sync(tree)
    Checkpoint(f"{base}/file", storage_options=opts).save_sync(os.urandom(50_000))
    for name, too_small in (("dir", total // 2), ("file", 10_000)):
        with pytest.raises(StorageFull, match=f"max_expand={too_small}"), \
                Checkpoint(tmp_path / f"w-{name}", f"{base}/{name}", storage_options=opts,
                           max_expand=too_small) as cp:
            cp.load_sync()
        with Checkpoint(tmp_path / f"ok-{name}", f"{base}/{name}", storage_options=opts,
                        max_expand=total + 100_000) as cp:
            assert cp.load_sync() is not None
    with pytest.raises(TypeError, match="max_expand"):
        Checkpoint(tmp_path / "x", max_expand="1 GiB")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_expand"):
        Checkpoint(tmp_path / "x", max_expand=-1)


def test_a_header_claiming_10_gib_is_stopped_before_any_byte_is_written(arena, tmp_path):
    """The 10 GiB bomb of the report, without building 10 GiB: the check is made on the member's header."""
    info = entry("huge.bin")
    info.size = 10 << 30
    blob = gzip.compress(info.tobuf(tarfile.PAX_FORMAT) + bytes(1 << 20))
    with mounted_tmpfs(tmp_path / "small", "size=64m") as folder:
        with pytest.raises(StorageFull, match="local disk a load extracts to") as err, \
                Checkpoint(tmp_path / "dest", _stored(arena, blob), workspace=folder) as cp:
            cp.load_sync()
        assert err.value.__cause__ is None
        assert list(folder.iterdir()) == []


@pytest.mark.parametrize("codec", ["gzip", "labelled", "zstd"])
def test_a_decompression_bomb_stops_before_the_disk_fills(arena, tmp_path, codec):
    """256 MiB of zeros, in many files, into a 32 MiB tmpfs: StorageFull from the budget, never ENOSPC."""
    piece = bytes(4 << 20)
    blob = CODECS[codec](tar([(entry(f"part-{i:03d}.bin"), piece) for i in range(64)]))
    retry = fast_counting()
    with mounted_tmpfs(tmp_path / "small", "size=32m") as folder:
        with pytest.raises(StorageFull, match="stopped before filling the disk") as err, \
                Checkpoint(tmp_path / "dest", _stored(arena, blob, codec), workspace=folder, retry=retry) as cp:
            cp.load_sync()
        assert err.value.__cause__ is None  # the budget said so; no write ever failed with ENOSPC
        assert list(folder.iterdir()) == []
        assert os.statvfs(folder).f_bfree == os.statvfs(folder).f_blocks
    assert retry.runs.count("load the checkpoint from") == 1


def test_an_archive_of_more_entries_than_free_inodes_stops_before_they_run_out(arena, tmp_path):
    blob = compressed([(entry(f"e{i:04d}"), b"") for i in range(1000)])
    with mounted_tmpfs(tmp_path / "few", "size=64m,nr_inodes=500") as folder:
        with pytest.raises(StorageFull, match="no inode is left") as err, \
                Checkpoint(tmp_path / "dest", _stored(arena, blob), workspace=folder) as cp:
            cp.load_sync()
        assert err.value.__cause__ is None
        assert list(folder.iterdir()) == []


@pytest.mark.parametrize("kind", ["bytes", "file"])
def test_a_raw_payload_larger_than_the_free_space_is_refused_before_copying(tmp_path, kind):
    data = os.urandom(4 << 20)
    if kind == "file":
        (tmp_path / "model.bin").write_bytes(data)
    Checkpoint(tmp_path / "ckpt").save_sync(data if kind == "bytes" else tmp_path / "model.bin")
    with mounted_tmpfs(tmp_path / "small", "size=2m") as folder:
        with pytest.raises(StorageFull, match="stopped before filling the disk") as err, \
                Checkpoint(tmp_path / "dest", tmp_path / "ckpt", workspace=folder) as cp:
            cp.load_sync()
        assert err.value.__cause__ is None  # refused by the check, not by a failed write
        assert list(folder.iterdir()) == []


def test_a_zstd_frame_asking_for_a_window_over_128_mib_is_refused(arena):
    """The memory a zstd reader may take is its window; a frame that asks for 256 MiB is damaged, not obeyed."""
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=28)
    c = zstandard.ZstdCompressor(compression_params=params).compressobj()  # streamed: the header names the window
    blob = c.compress(tar([(entry("ok.txt"), b"fine")])) + c.flush()
    assert zstandard.get_frame_parameters(blob).window_size == 1 << 28
    with pytest.raises(CheckpointCorruptError, match="too much memory"):
        arena.load(blob, record=True, codec="zstd")


def _stored(arena: Arena, blob: bytes, codec: str = "gzip") -> Path:
    (arena.store / "ckpt").write_bytes(blob)
    (arena.store / "ckpt.taskpoint.json").write_bytes(record_for(blob, "directory", RECORD_CODEC[codec]))
    return arena.store / "ckpt"


@pytest.mark.parametrize("lie", ["isize-too-big", "isize-too-small", "label-too-long"])
@pytest.mark.parametrize("record", [False, True], ids=["no-record", "forged-record"])
def test_a_labelled_member_that_lies_is_corrupt_at_once(arena, lie, record):
    size = 64 << 20
    if lie == "isize-too-big":
        blob = lying_member(size, size + 1024)
    elif lie == "isize-too-small":
        blob = lying_member(size, 1 << 20)
    else:
        blob = lying_member(1 << 20, (1 << 20) + 1536, label=3 << 30)
    with pytest.raises(CheckpointCorruptError, match=r"gzip member|label"):
        arena.load(blob, record=record)


# The peak RSS of the loader: VmHWM of its own memory map. getrusage's ru_maxrss cannot be used in a child
# started by pytest: Linux carries the parent's high-water mark into it across vfork and exec.
_RSS_SCRIPT = textwrap.dedent("""
    import json, re, sys, time
    from taskpoint import Checkpoint
    started = time.perf_counter()
    try:
        path = Checkpoint(sys.argv[1], sys.argv[2], workspace=sys.argv[3]).load_sync()
        outcome = "loaded"
    except Exception as exc:
        outcome = type(exc).__name__ + ": " + str(exc)[:200]
    with open("/proc/self/status") as status:
        peak_kib = int(re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1))
    print(json.dumps({"outcome": outcome, "seconds": time.perf_counter() - started, "peak_rss_mib": peak_kib / 1024}))
""")


def _load_in_subprocess(tmp_path: Path, src: Path, workspace: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "dest"), str(src), str(workspace)],
                          capture_output=True, text=True, check=True, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.e2e("starts a python process")
def test_three_lying_members_of_256_mib_each_keep_memory_bounded(arena, tmp_path):
    """The report's second bomb, scaled down: members that inflate far beyond their trailer; before, each
    was inflated whole (peak RSS = members in flight x their size)."""
    blob = lying_member(256 << 20, 4 << 20) * 3
    result = _load_in_subprocess(tmp_path, _stored(arena, blob, "labelled"), arena.ws)
    print(f"3 lying members of 256 MiB: {result}")
    assert result["outcome"].startswith("CheckpointCorruptError"), result
    assert result["peak_rss_mib"] < 200, result
    assert os.listdir(arena.ws) == []


@pytest.mark.e2e("starts a python process")
def test_100000_tiny_entries_load_with_bounded_memory(arena, tmp_path):
    """Memory per entry is a few small records (folder modes, links), never the data. The workspace is a tmpfs:
    creating 100,000 files on this machine's ext4 takes over a minute under load, and is not what is measured."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for d in range(100):
            t.addfile(entry(f"d{d:03d}", tarfile.DIRTYPE, mode=0o755))
            for f in range(1000):
                info = entry(f"d{d:03d}/f{f:04d}")
                info.size = 1
                t.addfile(info, io.BytesIO(b"x"))
    blob = gzip.compress(buf.getvalue(), 1)
    with mounted_tmpfs(tmp_path / "fast", "size=1g") as workspace:
        result = _load_in_subprocess(tmp_path, _stored(arena, blob), workspace)
        assert result["outcome"] == "loaded", result
        assert result["peak_rss_mib"] < 300, result
        assert sum(len(files) for _, _, files in os.walk(workspace)) == 100_000
    print(f"100,000 entries: {result['seconds']:.1f} s, peak RSS {result['peak_rss_mib']:.0f} MiB")


_FSIZE_SCRIPT = textwrap.dedent("""
    import resource, signal, sys
    from taskpoint import Checkpoint, RetryPolicy
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    runs = []
    class Counting(RetryPolicy):
        def call(self, fn, *, action, uri, endpoint=None, **kwargs):
            def counted(deadline):
                runs.append(action)
                return fn(deadline)
            return super().call(counted, action=action, uri=uri, endpoint=endpoint, **kwargs)
    try:
        Checkpoint(sys.argv[1], sys.argv[2], workspace=sys.argv[3], retry=Counting(initial_delay=0.01)).load_sync()
        print("loaded")
    except Exception as exc:
        print(type(exc).__name__, runs.count("load the checkpoint from"), str(exc))
""")


@pytest.mark.e2e("starts a python process")
def test_a_file_size_limit_while_extracting_is_storage_full_and_not_retried(arena, tmp_path):
    """EFBIG (RLIMIT_FSIZE) is a local failure: StorageFull at once, not four attempts and "check the network"."""
    src = _stored(arena, labelled(tar([(entry("big.bin"), bytes(3 << 20))])), "labelled")
    done = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT, str(tmp_path / "dest"), str(src), str(arena.ws)],
                          capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.startswith("StorageFull 1 "), done.stdout + done.stderr
    assert "network" not in done.stdout and "File too large" in done.stdout


# -- through the S3 server ------------------------------------------------------------------------------------


def _load_s3(store, blob: bytes, tmp_path: Path, *, record: bool = True, codec: str = "gzip") -> Path | None:
    src = store.url("ckpt")
    write_object(src, store.storage_options, blob)
    if record:
        write_object(src + ".taskpoint.json", store.storage_options, record_for(blob, "directory", RECORD_CODEC[codec]))
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    before = tree_state(tmp_path, ws)
    try:
        with Checkpoint(store.url("dest"), src, storage_options=store.storage_options, workspace=ws) as cp:
            return cp.load_sync()
    except BaseException:
        assert os.listdir(ws) == []
        raise
    finally:
        assert tree_state(tmp_path, ws) == before


def test_hostile_archives_through_s3_are_refused(s3_store, tmp_path):
    arena = Arena(tmp_path / "arena")
    for case in ("absolute-path", "item-13-link-chain", "hardlink-escape", "pax-path-override"):
        blob = compressed([(entry("ok.txt"), b"fine"), *_hostile(arena)[case]])
        with pytest.raises(UnsafeArchiveError):
            _load_s3(s3_store, blob, tmp_path / "arena")
    assert sorted(os.listdir(arena.sentinel / "victim")) == ["keep.txt"]


def test_bombs_through_s3_are_stopped(s3_store, tmp_path, monkeypatch):
    with pytest.raises(CheckpointCorruptError, match="gzip member"):
        _load_s3(s3_store, lying_member(64 << 20, 1 << 20), tmp_path, codec="labelled")
    monkeypatch.setattr(archive, "MAX_EXPAND", 4 << 20)
    with pytest.raises(StorageFull, match="max_expand"):
        _load_s3(s3_store, zeros_bomb(32 << 20, "zstd"), tmp_path, codec="zstd")


# -- damage: bit flips and truncations of stored objects and records -------------------------------------------

DAMAGE_TRIALS = 200


def _saved_checkpoints(root: Path) -> dict[str, tuple[Path, dict[str, Any] | bytes]]:
    """Checkpoints of every kind and codec, with what a correct load returns."""
    rng = random.Random(7)
    tree = make_tree(root / "tree", big=200_000)
    out: dict[str, tuple[Path, dict[str, Any] | bytes]] = {}
    for codec in ("gzip", "zstd", "none"):
        dest = root / f"dir-{codec}"
        Checkpoint(dest, codec=codec).save_sync(tree)
        out[dest.name] = (dest, snapshot(tree))
    data = rng.randbytes(150_000)
    Checkpoint(root / "bytes").save_sync(data)
    out["bytes"] = (root / "bytes", data)
    (root / "model.bin").write_bytes(data[::-1])
    Checkpoint(root / "file").save_sync(root / "model.bin")
    out["file"] = (root / "file", data[::-1])
    return out


def _damage(rng: random.Random, blob: bytes) -> tuple[str, bytes]:
    how = rng.choice(["flip", "flip", "flips", "truncate"])
    damaged = bytearray(blob)
    if how == "truncate":
        return how, bytes(damaged[: rng.randrange(len(blob))])
    for _ in range(1 if how == "flip" else rng.randint(2, 16)):
        damaged[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
    return how, bytes(damaged)


def _load_outcome(root: Path, src: Path, expected: dict[str, Any] | bytes) -> str:
    """"detected" (CheckpointCorruptError), or the error that should not have been; a wrong result fails."""
    ws = root / "ws"
    try:
        with Checkpoint(root / "out", src, workspace=ws) as cp:
            loaded = cp.load_sync()
            got = loaded.read_bytes() if isinstance(expected, bytes) else snapshot(loaded)  # type: ignore[union-attr]
    except CheckpointCorruptError:
        return "detected"
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(ws, ignore_errors=True)
    return "loaded correct data (damage not detected)" if got == expected else "WRONG DATA"


@pytest.mark.parametrize("trials", [
    DAMAGE_TRIALS,
    pytest.param(3000, id="3000", marks=[pytest.mark.slow,
                                         pytest.mark.campaign(f"3000 damages (make test: {DAMAGE_TRIALS})")]),
], ids=lambda n: str(n))
def test_random_damage_to_objects_and_records_is_always_detected(tmp_path, trials):
    rng = random.Random(20261201 + trials)
    saved = _saved_checkpoints(tmp_path)
    pristine = {name: (dest.read_bytes(), dest.with_name(dest.name + ".taskpoint.json").read_bytes())
                for name, (dest, _) in saved.items()}
    misses: list[str] = []
    kinds: dict[str, int] = {}
    for trial in range(trials):
        name = rng.choice(sorted(saved))
        dest, expected = saved[name]
        record = dest.with_name(dest.name + ".taskpoint.json")
        obj_bytes, rec_bytes = pristine[name]
        target = rng.choice(["object", "object", "record"])
        how, damaged = _damage(rng, obj_bytes if target == "object" else rec_bytes)
        dest.write_bytes(damaged if target == "object" else obj_bytes)
        record.write_bytes(damaged if target == "record" else rec_bytes)
        kinds[f"{target}-{how}"] = kinds.get(f"{target}-{how}", 0) + 1
        outcome = _load_outcome(tmp_path, dest, expected)
        if outcome != "detected":
            misses.append(f"trial {trial}: {name} {target} {how}: {outcome}")
    print(f"damage trials by kind: {kinds}")
    assert misses == [], "\n".join(misses)


def test_a_record_flip_that_stays_valid_json_is_detected(tmp_path):
    """A digit of the recorded CRC32, the size, the kind, the time: each still parses, each is caught."""
    Checkpoint(tmp_path / "ckpt").save_sync(b"state")
    record = tmp_path / "ckpt.taskpoint.json"
    good = record.read_text()
    doc = json.loads(good)["objects"][0]
    crc = doc["crc32"]
    for old, new in [(f'"{crc}"', f'"{crc[:-1]}{"0" if crc[-1] != "0" else "1"}"'), ('"size": 5', '"size": 4'),
                     ('"kind": "bytes"', '"kind": "bytez"'), (f'"created": {doc["created"]!r}', '"created": 1.5'),
                     ('"version": 2', '"version": 0'), ('"confirmed": null', '"confirmex": null'),
                     ('"confirmed": null', '"confirmed": "0123"')]:
        assert old in good, old
        record.write_text(good.replace(old, new))
        json.loads(record.read_text())
        with pytest.raises(CheckpointCorruptError), Checkpoint(tmp_path / "out", tmp_path / "ckpt") as cp:
            cp.load_sync()
    record.write_text(good)
    with Checkpoint(tmp_path / "out", tmp_path / "ckpt") as cp:
        assert cp.load_sync().read_bytes() == b"state"
