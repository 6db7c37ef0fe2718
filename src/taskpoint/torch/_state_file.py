"""The file of a ``torch.state_dict`` step and the manifest that commits it, written the same way by a blocking
save (in the trainer, :mod:`._state_kind`) and by the save process from a staged state (:mod:`._staged`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, ClassVar, cast

from .._progress import Progress
from ..format.fileset import PIECE_HASH, PIECE_SIZE, piece_hash_field, pieces_digest
from ..format.legacy import UNNAMED_PIECE_HASH
from ..format.names import STATE_DICT_KIND as STEP_KIND
from ..format.records import KIND_VERSION, ObjectRecord, StepManifest
from ..pieces import PieceWriter
from ..storage import Deadline, Location

STATE_FILE = "state_dict.pt"
"""The name of a state-dict step's one file: in the folder ``manager.restore(step)`` returns, and the path
``manager.open(step, STATE_FILE)`` reads."""

#: The codec the step's record names: the file as ``torch.save`` wrote it.
CODEC = "torch.save"


@dataclass(frozen=True)
class StateDictFile:
    """The content of a state-dict step: its file in the step's folder, and the digest (by ``piece_hash``) of
    each of its pieces (``piece_size`` bytes each, the last shorter)."""

    kind: ClassVar[str] = STEP_KIND
    file: str
    piece_size: int
    pieces: tuple[str, ...]
    piece_hash: str = UNNAMED_PIECE_HASH
    #: Where its file lies in the step's folder, as a :class:`~taskpoint.manager.kind_api.FilesKind` reads it: in it.
    folder: ClassVar[str] = ""

    @property
    def manifest_version(self) -> int:
        """The manifest's version: 5 for pieces hashed by anything but sha256, which a reader of version 4
        would check as sha256 (:data:`~taskpoint.format.records.FORMAT_VERSION`)."""
        return KIND_VERSION if self.piece_hash == UNNAMED_PIECE_HASH else KIND_VERSION + 1

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "piece_size": self.piece_size, **piece_hash_field(self.piece_hash),
                "pieces": list(self.pieces)}


def write_state(target: Location, save: Callable[[IO[bytes]], None], progress: Progress) -> tuple[int, list[str]]:
    """Write the state dict's file at ``target``: ``save(sink)`` (``torch.save``) into a :class:`PieceWriter`
    (fsynced on local disk); its size and the digests of its pieces."""

    def write(deadline: Deadline) -> tuple[int, list[str]]:
        progress.rewind()
        with target.open_write(deadline=deadline) as sink:
            writer = PieceWriter(sink, PIECE_SIZE, progress.update, piece_hash=PIECE_HASH)
            try:
                save(cast("IO[bytes]", writer))
                return writer.finish()
            finally:
                writer.shutdown()

    return target.run(write, action="save the state dict to", writing=True)


def state_manifest(step: int, attempt: int | None, metadata: dict[str, Any], save_id: str, name: str, size: int,
                   digests: list[str]) -> StepManifest:
    """The manifest that commits a state-dict step whose file ``name`` holds ``size`` bytes in those pieces."""
    record = ObjectRecord(kind=STEP_KIND, codec=CODEC, save_id=save_id, created=time.time(), size=size,
                          sha256=pieces_digest(digests))
    return StepManifest(step=step, record=record, attempt=attempt, metadata=metadata,
                        content=StateDictFile(name, PIECE_SIZE, tuple(digests), PIECE_HASH))
