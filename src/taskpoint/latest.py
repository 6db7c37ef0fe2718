"""Find the newest checkpoint file in a restored tree, by the training progress its name encodes."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path, PurePath
from typing import Any, NamedTuple

# ``epoch=3``, ``step=400`` (Lightning's ``auto_insert_metric_name``) and ``epoch03`` / ``step400``
# (``auto_insert_metric_name=False``). The look-behind keeps ``train_step=5`` from reading as ``step``.
_PROGRESS_FIELD = re.compile(r"(?<![A-Za-z0-9_])(epoch|step)=?(\d+)")
# Lightning appends ``-v1``, ``-v2``, ... when the name it wants is already taken by an earlier run.
_CLASH_SUFFIX = re.compile(r"-v(\d+)$")
_VERSION_DIR = re.compile(r"version_(\d+)")
_LAST_STEM = "last"
_UNKNOWN = -1


class _Rank(NamedTuple):
    """Sort key of one candidate; fields compare in this order, larger is newer."""

    versions: tuple[int, ...]  # N of each ``version_N`` folder on the way down, outermost first
    progress: tuple[int, int]  # (step, epoch); -1 where the name does not say
    is_last: bool  # ``last.ckpt`` beats a sibling at the same progress
    clash: int  # N of a ``-vN`` suffix, 0 without one
    mtime_ns: int  # only when everything above ties
    parts: tuple[str, ...]  # never meaningful: makes the answer independent of listing order


def latest_checkpoint(
    path: str | os.PathLike[str],
    glob_pattern: str = "**/*.ckpt",
    *,
    key: Callable[[Path], Any] | None = None,
) -> Path | None:
    """Return the newest file under ``path`` matching ``glob_pattern``, or ``None`` if there is none.

    Only files match (a folder named ``x.ckpt`` never does); a missing ``path`` gives ``None``.
    A ``path`` that is itself a file is a tree of one: it is returned when its name matches the
    pattern's last part and every part before it is ``**``, else ``None``.

    Without ``key``, "newest" is decided by the names, so a tree copied from storage (every mtime
    equal) still gives the right answer. Larger wins, rule by rule:

    1. ``version_N`` folders on the path below ``path``, compared numerically (``version_10`` >
       ``version_9``); a file in no such folder ranks below any file in one.
    2. Training progress in the file name: ``step`` then ``epoch`` (``epoch=3-step=400-val_loss=0.1``,
       ``step=400``, ``epoch=3``, or ``epoch03-step400``); a name without them ranks below any name with
       them. ``last.ckpt`` takes the highest progress of the checkpoints in its own folder ...
    3. ... and then beats them: it is the newest file in its folder.
    4. Lightning's clash suffix ``-vN`` (``last-v1.ckpt``, ``epoch=1-step=10-v1.ckpt``): a later run.
    5. Modification time.
    6. The relative path, so that full ties give the same answer on every file system.

    With ``key``, the ranking above is not used: the match with the largest ``key(match)`` wins.
    """
    root = Path(os.fspath(path))
    if root.is_file():
        return root if _lone_file_matches(glob_pattern, root.name) else None
    if not root.is_dir():
        return None
    # Sorted so that ties under a user's key go to the same file on every file system.
    matches = sorted((p for p in root.glob(glob_pattern) if p.is_file()), reverse=True)
    if not matches:
        return None
    if key is not None:
        return max(matches, key=key)
    ranks = _Ranker(root)
    return max(matches, key=ranks.rank)


class _Ranker:
    """Builds :class:`_Rank` keys, listing each folder at most once to date ``last`` files."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._folder_progress: dict[tuple[Path, str], tuple[int, int]] = {}

    def rank(self, file: Path) -> _Rank:
        rel = file.relative_to(self._root)
        versions = tuple(int(m.group(1)) for d in rel.parts[:-1] if (m := _VERSION_DIR.fullmatch(d)))
        stem, clash = _split_clash_suffix(file.stem)
        is_last = stem == _LAST_STEM
        progress = self._progress_of_folder(file.parent, file.suffix) if is_last else _progress(file.name)
        return _Rank(versions, progress, is_last, clash, file.stat().st_mtime_ns, rel.parts)

    def _progress_of_folder(self, folder: Path, suffix: str) -> tuple[int, int]:
        """Highest progress among the files of ``folder`` with ``suffix``; matched by the pattern or not."""
        cache_key = (folder, suffix)
        if cache_key not in self._folder_progress:
            best = (_UNKNOWN, _UNKNOWN)
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.endswith(suffix) and entry.is_file():
                        best = max(best, _progress(entry.name))
            self._folder_progress[cache_key] = best
        return self._folder_progress[cache_key]


def _progress(name: str) -> tuple[int, int]:
    """``(step, epoch)`` from a file name; -1 for what it does not carry. The first of each counts."""
    found: dict[str, int] = {}
    for m in _PROGRESS_FIELD.finditer(name):
        found.setdefault(m.group(1), int(m.group(2)))
    return found.get("step", _UNKNOWN), found.get("epoch", _UNKNOWN)


def _split_clash_suffix(stem: str) -> tuple[str, int]:
    m = _CLASH_SUFFIX.search(stem)
    return (stem[: m.start()], int(m.group(1))) if m else (stem, 0)


def _lone_file_matches(glob_pattern: str, name: str) -> bool:
    """Whether globbing a folder holding only this file would find it at the top level."""
    parts = PurePath(glob_pattern).parts
    if not parts:
        raise ValueError(f"Unacceptable pattern: {glob_pattern!r}")
    *folders, last = parts
    return all(part == "**" for part in folders) and fnmatchcase(name, last)
