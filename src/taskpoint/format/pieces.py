"""A payload step's object recorded by pieces: the BLAKE3 of each :data:`~.fileset.PIECE_SIZE` piece of its stored
bytes, in order (step manifest version 7), and ranged reads that check the pieces they cover.

Why pieces: one BLAKE3 of a whole object runs on one core, about 5 GB/s here, below the 6.9 GB/s at which a
verify reads the page cache, and it vouches only for the whole object, so a partial restore through an archive's
index (:mod:`.subset`) could check only each gzip member's CRC32. Pieces hash on every core at once in a verify of
local disk (:func:`~taskpoint.digests.pieces_of_file`), beside the stream elsewhere
(:class:`~taskpoint.digests.PayloadPieces`), and a ranged read widened to whole pieces checks every byte it uses
(:class:`~.subset.CheckedRanges`). The pieces are listed as a file set lists a large file's (``piece_size``,
``piece_hash``, ``pieces``; :mod:`.fileset`), with the same piece size and hash.
"""

from __future__ import annotations

from typing import Any

from .fileset import PIECE_HASH, PIECE_SIZE, FileEntry, piece_spans, read_piece_hash

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


def checked_by(sha256: str | None, blake3: str | None, pieces: tuple[str, ...]) -> dict[str, Any]:
    """What a record checks its object by, as ``taskpoint show`` prints it: the count, size and hash of its pieces
    and their digests (``piece_digests``; manifest version 7 on), else its one BLAKE3 (version 6), else its sha256
    (older, and the records of file sets and state dicts); ``sha256`` always, null when the record has none, as
    ``show --json`` printed it before pieces."""
    if pieces:
        return {"sha256": sha256, "pieces": len(pieces), "piece_size": PIECE_SIZE, "piece_hash": PIECE_HASH,
                "piece_digests": list(pieces)}
    return {"sha256": sha256, **({} if blake3 is None else {"blake3": blake3})}


def piece_damage(subject: str, index: int, piece_size: int, size: int, hash_name: str, *, name: str = "",
                 whole: bool = False, also: int = 0, count: int = 0) -> str:
    """The one sentence for a piece of a stored object or file that does not match its digest, whoever found it
    (a verify, a restore, a ranged read, a DCP or state-dict load): "``subject`` is damaged: piece 3 of ``name``
    (bytes 50331648-67108863) does not match the blake3 recorded when it was saved ..."; ``whole``: an object
    recorded by one digest of all ``size`` bytes (named, no piece); ``also``: how many more of its ``count`` pieces
    differ."""
    if whole:
        what = f"{name or 'it'} does not match the {hash_name} recorded when it was saved"
    else:
        start = index * piece_size
        end = max(start, min(start + piece_size, size) - 1)
        what = (f"piece {index}{f' of {name}' if name else ''} (bytes {start}-{end}) does not match the {hash_name} "
                "recorded when it was saved")
    more = f", and {also} more of its {count} pieces" if also else ""
    return (f"{subject} is damaged: {what}{more} (a changed byte, or truncated or extended: it was saved with "
            f"{size} bytes)")


def count_damage(subject: str, found: int, found_size: int, recorded: int, size: int, name: str = "") -> str:
    """The sentence for an object or file read as a number of pieces its manifest does not record (one longer or
    shorter by a piece or more, or a reader that split it wrong): "``subject`` is damaged: read 2 pieces of
    ``name`` (16777217 bytes), the manifest records 1 (16777216 bytes)"."""
    of = f" of {name}" if name else ""
    return (f"{subject} is damaged: read {found} piece{'s' if found != 1 else ''}{of} ({found_size} bytes), the "
            f"manifest records {recorded} ({size} bytes)")


def pieces_damage(subject: str, recorded: tuple[str, ...], hexdigest: str, found_size: int, size: int,
                  name: str = "") -> str | None:
    """Where bytes read as ``found_size`` bytes whose :data:`PAYLOAD_PIECES` hexdigest is ``hexdigest`` differ from
    the ``recorded`` pieces of an object of ``size`` bytes: :func:`count_damage` when their counts differ, else
    :func:`piece_damage` of the first piece that differs; None when every piece matches."""
    found = split_pieces(hexdigest)
    if len(found) != len(recorded):
        return count_damage(subject, len(found), found_size, len(recorded), size, name)
    bad = [i for i, (want, got) in enumerate(zip(recorded, found, strict=True)) if want != got]
    if not bad:
        return None
    return piece_damage(subject, bad[0], PIECE_SIZE, size, PIECE_HASH, name=name, also=len(bad) - 1,
                        count=len(recorded))


def entry_damage(subject: str, entry: FileEntry, found: int | FileEntry, name: str = "") -> str:
    """The damage of a file listed by ``entry`` (a file listed whole: named, no piece): ``found`` is the piece
    that differs, or the entry of what was read: :func:`count_damage` when its size makes another number of pieces
    (a reader of local disk hashes only the pieces the entry lists, so the size counts them), else its first piece
    that differs (the last when only the size differs)."""
    if isinstance(found, FileEntry):
        count = len(piece_spans(found.size, entry.piece_size))
        if entry.pieces and count != len(entry.pieces):
            return count_damage(subject, count, found.size, len(entry.pieces), entry.size, name)
        found = next((index for index, (a, b) in enumerate(zip(entry.pieces, found.pieces, strict=False)) if a != b),
                     max(0, len(entry.pieces) - 1))
    return piece_damage(subject, found, entry.piece_size, entry.size, entry.hash_name, name=name,
                        whole=not entry.pieces)
