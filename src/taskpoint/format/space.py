"""The room a load may take: free space and inodes of the folder it extracts to, and a fixed limit if set."""

from __future__ import annotations

import os

from ..errors import StorageFull


class SpaceBudget:
    """What a load may still write below ``folder``: the free space and free inodes of its file system (less
    a small reserve), and at most ``max_expand`` bytes of content.

    Charges are made before anything is written. The free space is read again every
    :attr:`REFRESH` bytes and before refusing, so that other writers on the same disk are taken into account.
    File sizes are rounded up to the file system's block size, and each folder counts one block.
    """

    REFRESH = 256 << 20

    def __init__(self, folder: str | os.PathLike[str], uri: str, max_expand: int | None = None) -> None:
        self.folder = os.fspath(folder)
        self.uri = uri
        self.max_expand = max_expand
        self.expanded = 0  # bytes of content charged so far
        self._block = 4096
        self._room: int | None = None  # bytes that may still be used, None when unknown
        self._inodes: int | None = None  # entries that may still be created, None when unknown
        self._since = 0  # bytes charged since the free space was read
        self._entries = 0  # entries charged since then
        self._refresh()

    def _refresh(self) -> None:
        self._since = self._entries = 0
        try:
            st = os.statvfs(self.folder)
        except OSError:  # no figures (an odd file system): only max_expand applies
            self._room = self._inodes = None
            return
        self._block = st.f_frsize or st.f_bsize or 4096
        total = st.f_blocks * self._block
        self._room = st.f_bavail * self._block - min(total // 100, 64 << 20)
        self._inodes = st.f_favail - min(st.f_files // 100, 1000) if st.f_files else None

    def _over(self) -> bool:
        return (self._room is not None and self._since > self._room) or (
            self._inodes is not None and self._entries > self._inodes)

    def charge(self, size: int, *, what: str = "", folder: bool = False) -> None:
        """Account for one new entry holding ``size`` bytes (a ``folder`` takes a block); StorageFull when it
        would not fit."""
        if self.max_expand is not None and self.expanded + size > self.max_expand:
            raise StorageFull(
                f"could not load {self.uri}: it expands to more than max_expand={self.max_expand} bytes "
                f"({self.expanded} so far, then {size} for {what or 'the next entry'}); stopped before writing "
                "it. If this checkpoint is genuine, pass a larger max_expand= to Checkpoint (or raise "
                "taskpoint.format.extract.MAX_EXPAND); otherwise load an older one.")
        self.expanded += size
        used = -(-size // self._block) * self._block + (self._block if folder else 0)
        self._since += used
        self._entries += 1
        if self._since > self.REFRESH or self._over():
            # What was charged before is written by now: the file system's own figures replace the estimate.
            self._refresh()
            self._since, self._entries = used, 1
            if self._over():
                raise StorageFull(
                    f"could not load {self.uri}: no space left on the local disk a load extracts to "
                    f"({self.folder}): {what or 'the next entry'} needs {used} bytes and "
                    f"{max(self._room or 0, 0)} are free (less a reserve), or no inode is left; stopped before "
                    "filling the disk. Free some space, or load into a folder on a larger disk; nothing was lost.")


def check_room(folder: str | os.PathLike[str], size: int, uri: str, max_expand: int | None = None) -> None:
    """StorageFull when a file of ``size`` bytes would not fit in ``folder``'s file system, or exceeds
    ``max_expand`` (see SpaceBudget)."""
    SpaceBudget(folder, uri, max_expand).charge(size, what="the payload")
