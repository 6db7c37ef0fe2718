"""The readers of stored forms taskpoint no longer writes, in one table: each older form, what replaced it, and the
commit that did.

In the manner of a migration index, each reader (:attr:`OlderReader.upgrade`) checks a document of its form by the
rules of the taskpoint that wrote it, then hands it on in the form today's reader reads, so that the readers of
:mod:`.records`, :mod:`.fileset` and the step kinds know only what is written now.
:func:`~.sealing.parse` consults the table for every sealed document after its check and before its reader: a
document without a check is read only through an entry of this table (everything written now carries one).
The field sets below are those the writers of the time wrote, frozen here, not derived from today's classes.
``docs/format.md`` lists the same forms in its version table ("no; read"). The core's one kind of file sets
(:mod:`taskpoint.manager.kinds.files`) added no entry: it writes the kind names and versions written before it
(``jax.pytree``, ``fileset``), so that older taskpoints read its steps (docs/format.md, "One kind of file sets,
under the names already written").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .names import CHECKPOINT_FORMAT as CHECKPOINT
from .names import FILESET_FORMAT as FILESET
from .names import SHARD_FORMAT as SHARD
from .names import STATE_DICT_KIND
from .names import STEP_FORMAT as STEP

#: The key under which the upgrade of a version-1 checkpoint record hands on its ``pending`` entry (a save that
#: stopped before recording its digest), which no later version has: :class:`~.records.Record` reads it as
#: ``unverified``, and only from an upgraded (unchecked) document.
PENDING = "pending"
#: The hash of pieces whose document names none (file sets of version 2, state-dict steps of manifest version 4).
UNNAMED_PIECE_HASH = "sha256"

Upgrade = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class OlderReader:
    """A reader of ``format`` ``version`` as an older taskpoint wrote it (``sealed``: with its ``check``; else
    without one), and what replaced that form: ``successor`` (the version, or the sealed form) introduced by
    commit ``since``."""

    format: str
    version: int
    sealed: bool
    successor: str
    since: str
    #: Checks the document by its form's rules (ValueError, TypeError, KeyError: damaged) and returns it in the
    #: form today's reader reads.
    upgrade: Upgrade


def _fields(doc: dict[str, Any], known: frozenset[str], what: str,
            why: str = "has fields no taskpoint wrote in it") -> None:
    unknown = set(doc) - known
    if unknown:
        raise ValueError(f"{what} {why} ({sorted(unknown)})")


#: The fields of an entry of a version-1 checkpoint record (``check``: written by one development build, e550d28;
#: ``index``, which no version-1 writer wrote, as accepted before this table).
_RECORD_1_ENTRY = frozenset({"kind", "codec", "save_id", "created", "size", "sha256", "crc32", "index", "check"})
_RECORD_1 = frozenset({"format", "version", "committed", "pending", "interrupted"})


def _record_1(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 1 (``committed`` and ``pending``, written twice per save) as version 2: the committed object is
    the one listed and confirmed; a pending one, or ``interrupted``, asks the next save to sweep."""
    _fields(doc, _RECORD_1, "a version-1 record")
    committed, pending = doc.get("committed"), doc.get("pending")
    for entry in (committed, pending):
        if entry is not None:
            _fields(entry, _RECORD_1_ENTRY, "an entry of a version-1 record")
    plain = [None if e is None else {k: v for k, v in e.items() if k != "check"} for e in (committed, pending)]
    return {"format": CHECKPOINT, "version": 2, "objects": [plain[0]] if plain[0] is not None else [],
            "confirmed": None if committed is None else committed["save_id"],
            "sweep": pending is not None or bool(doc.get("interrupted", False)), PENDING: plain[1]}


#: Every field of a step manifest and of a rank's record as written before they carried a check (b2dcf6f).
_UNSEALED_STEP = frozenset({"format", "version", "step", "payload", "attempt", "metadata", "tree", "shards", "kind",
                            "codec", "save_id", "created", "size", "sha256", "crc32", "index"})
_UNSEALED_SHARD = frozenset({"format", "version", "step", "world_size", "round", "shard"})
#: What is wrong with a document without a check that has a field its writers never wrote.
_UNSEALED_WHY = "has no check and fields no taskpoint writes without one"


def _as_written(known: frozenset[str], what: str, why: str = "has fields no taskpoint wrote in it") -> Upgrade:
    """A document today's reader reads as it is (one of the time before documents carried a check, reported
    unchecked; or a sealed one whose objects are recorded by one BLAKE3, checked so): a field its writers never
    wrote is damage (most likely the name ``check`` with a flipped bit)."""
    def upgrade(doc: dict[str, Any]) -> dict[str, Any]:
        _fields(doc, known, what, why)
        return doc
    return upgrade


def _named_pieces(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` (a file's, or a state dict's content) with its pieces' hash named: sha256 when it names none."""
    return {**entry, "piece_hash": entry.get("piece_hash", UNNAMED_PIECE_HASH)} if "pieces" in entry else entry


def _fileset_2(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 2 (files over 16 MiB by sha256 pieces, their hash unnamed) as version 3, which names it."""
    files = doc["files"]
    if not isinstance(files, dict):
        raise TypeError("files is not a JSON object")
    return {**doc, "version": 3, "files": {name: _named_pieces(entry) for name, entry in files.items()}}


def _state_dict_4(doc: dict[str, Any]) -> dict[str, Any]:
    """Manifest version 4 of a ``torch.state_dict`` step (sha256 pieces, their hash unnamed) as version 5, which
    names it; any other kind's version 4 is written now and passes unchanged."""
    if doc.get("step_kind") != STATE_DICT_KIND:
        return doc
    content = doc["content"]
    if not isinstance(content, dict):
        raise TypeError("the content is not a JSON object")
    return {**doc, "version": 5, "content": _named_pieces(content)}


#: The fields of a step manifest of version 6 and of a shard record of version 2 (payload objects by one BLAKE3), as
#: their writers wrote them.
_BLAKE3_STEP = frozenset({"format", "version", "step", "step_kind", "content", "kind", "codec", "save_id", "created",
                          "size", "sha256", "crc32", "blake3", "index", "attempt", "metadata", "check"})
_BLAKE3_SHARD = frozenset({"format", "version", "step", "world_size", "round", "shard", "check"})


#: Every older form taskpoint reads, oldest first within each format.
OLDER_READERS: tuple[OlderReader, ...] = (
    OlderReader(CHECKPOINT, 1, False, "version 2", "f5cdb59 (2026-12-01)", _record_1),
    *(OlderReader(STEP, version, False, f"version {version}, sealed", "b2dcf6f (2026-12-02)",
                  _as_written(_UNSEALED_STEP, "it", _UNSEALED_WHY))
      for version in (1, 2, 3)),
    OlderReader(SHARD, 1, False, "version 1, sealed", "b2dcf6f (2026-12-02)",
                _as_written(_UNSEALED_SHARD, "it", _UNSEALED_WHY)),
    OlderReader(STEP, 4, True, "version 5 (torch.state_dict by BLAKE3 pieces)", "0e255e0 (2026-12-05)", _state_dict_4),
    OlderReader(STEP, 6, True, "version 7 (every payload object by BLAKE3 pieces)", "758143b (2026-12-06)",
                _as_written(_BLAKE3_STEP, "a version-6 step manifest")),
    OlderReader(SHARD, 2, True, "version 3 (the shard by BLAKE3 pieces)", "758143b (2026-12-06)",
                _as_written(_BLAKE3_SHARD, "a version-2 shard record")),
    OlderReader(FILESET, 2, True, "version 3", "0e255e0 (2026-12-05)", _fileset_2),
)

_BY_FORM = {(r.format, r.version, r.sealed): r for r in OLDER_READERS}


def older_reader(fmt: str, version: int, sealed: bool) -> OlderReader | None:
    """The reader of this older form, None when taskpoint writes it now (or never wrote it)."""
    return _BY_FORM.get((fmt, version, sealed))
