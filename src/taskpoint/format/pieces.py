"""A payload step's object recorded by pieces: the BLAKE3 of each :data:`~.fileset.PIECE_SIZE` piece of its stored
bytes, in order (step manifest version 7), and ranged reads that check the pieces they cover.

Why pieces: one BLAKE3 of a whole object runs on one core, about 5 GB/s here, below the 6.9 GB/s at which a
verify reads the page cache, and it vouches only for the whole object, so a partial restore through an archive's
index (:mod:`.subset`) could check only each gzip member's CRC32. Pieces hash on every core at once
(:class:`~taskpoint.digests.PieceDigests`), and a ranged read widened to whole pieces checks every byte it uses
(:class:`~.subset.CheckedRanges`). The pieces are listed as a file set lists a large file's (``piece_size``,
``piece_hash``, ``pieces``; :mod:`.fileset`), with the same piece size and hash.
"""

from __future__ import annotations

from typing import Any

from .fileset import PIECE_HASH, PIECE_SIZE, piece_spans, read_piece_hash

#: The :data:`~taskpoint.digests.DIGESTS` name of an object recorded by pieces: its hexdigest is the BLAKE3 of
#: each :data:`~.fileset.PIECE_SIZE` piece, in order, concatenated (:attr:`~.records.ObjectRecord.pieces`).
PAYLOAD_PIECES = "blake3-pieces"
#: Hex digits of one piece's BLAKE3.
PIECE_HEX = 64


def split_pieces(hexdigest: str, size: int | None = None) -> tuple[str, ...]:
    """The piece digests of a :data:`PAYLOAD_PIECES` hexdigest; with ``size``, ValueError unless there is one
    digest per piece of an object of that size."""
    pieces = tuple(hexdigest[at:at + PIECE_HEX] for at in range(0, len(hexdigest), PIECE_HEX))
    if size is not None and (len(pieces) != len(piece_spans(size)) or any(len(p) != PIECE_HEX for p in pieces)):
        raise ValueError(f"an object of {size} bytes is recorded by {len(pieces)} pieces of {PIECE_SIZE} bytes")
    return pieces


def pieces_json(pieces: tuple[str, ...]) -> dict[str, Any]:
    """The fields of a record of an object by ``pieces``."""
    return {"piece_size": PIECE_SIZE, "piece_hash": PIECE_HASH, "pieces": list(pieces)}


def read_pieces(doc: dict[str, Any], size: Any) -> tuple[str, ...]:
    """The pieces a record lists (:func:`pieces_json`) for an object of ``size`` bytes; ValueError for another
    piece size or hash, or a count that does not fit the size (TypeError for no size)."""
    if read_piece_hash(doc) != PIECE_HASH or int(doc["piece_size"]) != PIECE_SIZE:
        raise ValueError(f"an object is recorded by {doc['piece_hash']} pieces of {doc['piece_size']} bytes")
    return split_pieces("".join(str(each) for each in doc["pieces"]), int(size))


def damaged_pieces(recorded: tuple[str, ...], hexdigest: str, size: int) -> str:
    """Where bytes of ``size`` whose :data:`PAYLOAD_PIECES` hexdigest is ``hexdigest`` differ from the ``recorded``
    pieces: "piece 3 (bytes 50331648-67108863)", and how many more; "" when they do not differ piece for piece
    (no pieces recorded, or another count of them: the object's size differs)."""
    found = split_pieces(hexdigest)
    if not recorded or len(found) != len(recorded):
        return ""
    bad = [i for i, (want, got) in enumerate(zip(recorded, found, strict=True)) if want != got]
    if not bad:
        return ""
    start, length = piece_spans(size)[bad[0]]
    more = f" and {len(bad) - 1} more of its {len(recorded)} pieces" if len(bad) > 1 else ""
    return f"piece {bad[0]} (bytes {start}-{start + max(length, 1) - 1}){more}"
