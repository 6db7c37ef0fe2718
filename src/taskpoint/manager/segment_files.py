"""The files of one staging segment, and one mapping of them all.

The trainer's copy into a fresh segment (:meth:`~.staging.Segment.fill`) is also where tmpfs allocates the segment's
pages, and it allocates a file's pages under that file's lock: the ``pwrite`` calls of two threads into one file take
turns, so that a segment of one file is allocated on one core. Measured here (256 MiB of four tensors into
``/dev/shm``, two threads, 9 alternating rounds, load 1): one file 1.86x a ``clone()`` of the tensors into fresh
memory (which faults its pages in on both cores), two files of half the size, a thread each, 0.96x. So a segment is
made of :func:`part_count` files: the *head* at the segment's path, whose name is the segment's (its owner, its key),
then ``<head>.1``, ``<head>.2``, ... each holding the next bytes of the segment. Every part but the last is the same
whole number of pages, so that a reader maps them at consecutive addresses (:func:`map_parts`) and sees one buffer,
as of one file; a thing staged across the boundary of two parts is contiguous there too.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import mmap
import os
import weakref
from collections.abc import Iterable
from pathlib import Path

#: The fewest bytes a part holds: a segment smaller than two of them is one file (allocating it is short anyway).
MIN_PART = 1 << 20
#: The most files a segment is made of, whatever the number of threads that fill it.
MAX_PARTS = 8

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux's values on every architecture Python runs on (Python's mmap names neither)
_PROT_NONE = 0


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library's ``mmap`` and ``munmap``, loaded on first use (only a segment of several files needs them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def part_count(size: int, threads: int) -> int:
    """How many files a new segment of ``size`` bytes is made of: one per thread that fills it, each of at least
    :data:`MIN_PART` bytes, at most :data:`MAX_PARTS`."""
    return max(1, min(threads, MAX_PARTS, size // MIN_PART))


def part_sizes(size: int, count: int) -> list[int]:
    """The sizes of ``count`` parts that hold ``size`` bytes: each but the last the same whole number of pages (the
    last ones empty when ``size`` is small for ``count``, after a segment shrank)."""
    chunk = -(-size // count)
    chunk = -(-chunk // mmap.PAGESIZE) * mmap.PAGESIZE
    return [max(0, min(chunk, size - index * chunk)) for index in range(count)]


def part_path(head: Path, index: int) -> Path:
    """The file of part ``index`` of the segment whose head is ``head`` (``head`` itself for part 0)."""
    return head if index == 0 else head.with_name(f"{head.name}.{index}")


def part_paths(head: Path) -> list[Path]:
    """The files of the segment at ``head`` as they are now, in order: ``head``, then each ``<head>.N`` there is."""
    paths = [head]
    while (following := part_path(head, len(paths))).exists():
        paths.append(following)
    return paths


def part_files(head: Path) -> list[tuple[Path, int]]:
    """The files of the segment at ``head`` as they are now, in order, each with its size. FileNotFoundError when
    it is gone."""
    files: list[tuple[Path, int]] = []
    while True:
        path = part_path(head, len(files))
        try:
            files.append((path, os.stat(path).st_size))
        except FileNotFoundError:
            if not files:
                raise
            return files


def stored_size(head: Path) -> int:
    """The bytes of the segment at ``head``: those of all its files. FileNotFoundError when it is gone."""
    return sum(size for _, size in part_files(head))


def spread(writes: Iterable[tuple[int, memoryview]], sizes: list[int]) -> list[tuple[int, int, memoryview]]:
    """Each ``(offset, bytes)`` of ``writes`` into a segment whose files hold ``sizes`` bytes, as ``(file, offset in
    it, bytes)``, split where a file ends (bytes past the last file's end go to it), then taken in turn across the
    files: the threads that take them one after another write files of their own, mostly."""
    starts = list(itertools.accumulate(sizes, initial=0))[:-1]
    by_file: list[list[tuple[int, int, memoryview]]] = [[] for _ in sizes]
    for at, data in writes:
        while True:
            index = bisect.bisect_right(starts, at) - 1
            length = data.nbytes if index == len(sizes) - 1 else min(data.nbytes, starts[index + 1] - at)
            by_file[index].append((index, at - starts[index], data[:length]))
            if length == data.nbytes:
                break
            at, data = at + length, data[length:]
    return [write for turn in itertools.zip_longest(*by_file) for write in turn if write is not None]


def map_parts(files: list[tuple[Path, int]]) -> memoryview:
    """One writable buffer over ``files`` (each a path and its size, as :func:`part_files` gives them), mapped
    (shared) at consecutive addresses: an address range reserved whole, then each file mapped into its place. The
    range is unmapped once nothing uses the buffer any more (no view of it, nor of anything made over it, is left),
    as a Python ``mmap`` closes when its last export goes. OSError when a file cannot be mapped, nothing left
    mapped."""
    total, libc = sum(size for _, size in files), _libc()
    base = libc.mmap(None, total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"cannot reserve {total} bytes of addresses for a staging segment")
    try:
        start = 0
        for path, size in files:
            if size:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    placed = libc.mmap(base + start, size, mmap.PROT_READ | mmap.PROT_WRITE,
                                        mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
                    error = ctypes.get_errno()
                finally:
                    os.close(fd)
                if placed != base + start:
                    raise OSError(error, f"cannot map {path} at its place in its staging segment")
            start += size
    except BaseException:
        libc.munmap(base, total)
        raise
    region = (ctypes.c_ubyte * total).from_address(base)
    # Unmapped when the last view of the region is gone; never at exit, where a thread still reading it would
    # crash (the process's end unmaps it).
    weakref.finalize(region, libc.munmap, base, total).atexit = False
    return memoryview(region).cast("B")
