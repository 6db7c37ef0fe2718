"""What a DCP checkpoint written by :class:`~taskpoint.torch.Writer` holds, and what passes between ranks.

Layout under the checkpoint's URI (a folder or prefix)::

    __{rank}_{n}-{save}.distcp   the tensors and bytes of one rank, split into files uploaded in parallel
    taskpoint.dcp.json           taskpoint's manifest: every file above and .metadata, with size and BLAKE3 pieces
    .metadata                    DCP's metadata (pickled), written last: the commit

The data files and ``.metadata`` are DCP's own format, so DCP's readers load the checkpoint too (without
any verification).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ..format.fileset import FileEntry
from ..format.names import DCP_FILESET_KIND
from ..storage import Location, RetryPolicy, normalize_uri

#: DCP's metadata file: its presence commits the checkpoint.
METADATA_NAME = ".metadata"
#: taskpoint's manifest, written just before the commit; a manager step of such a checkpoint names it.
MANIFEST_NAME = "taskpoint.dcp.json"
#: The ``kind`` of a DCP checkpoint's file-set manifest.
MANIFEST_KIND = DCP_FILESET_KIND
#: Data files of a save (``save`` is the first 12 hex digits of the coordinator's save id).
DATA_FILE = re.compile(r"__(0|[1-9][0-9]*)_(0|[1-9][0-9]*)-[0-9a-f]{12}\.distcp")
#: Files of one rank uploaded at once by default (each an atomic upload with its own parts in flight).
DEFAULT_THREADS = 4


@dataclass(frozen=True)
class FilePrefix:
    """``SavePlan.storage_data`` of one rank, set by the coordinator: its rank and the save's short id."""

    rank: int
    save: str

    def name(self, number: int) -> str:
        """The name of this rank's data file ``number``."""
        return f"__{self.rank}_{number}-{self.save}.distcp"


@dataclass(frozen=True)
class StoredItem:
    """``WriteResult.storage_data`` from a rank to the coordinator: where one item landed, and the manifest's
    entry of its whole file (size and BLAKE3 pieces). The coordinator turns it into DCP's ``_StorageInfo``."""

    relative_path: str
    offset: int
    length: int
    file: FileEntry


def root_location(uri: str | os.PathLike[str], storage_options: dict[str, Any] | None,
                  retry: RetryPolicy | None) -> Location:
    """The checkpoint's folder as a Location; clear errors for a URI or options of the wrong type."""
    text = normalize_uri(uri, "the checkpoint URI")
    if not text.strip():
        raise ValueError("the checkpoint URI is empty; pass the folder (any fsspec URL) the checkpoint goes to")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict, not {type(storage_options).__name__}")
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry must be a taskpoint.RetryPolicy, not {type(retry).__name__}")
    return Location(text.rstrip("/") or text, storage_options, retry)


def check_threads(threads: int) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, not {threads!r}")
    return threads


class Rooted:
    """What the writer and the reader share: the checkpoint's folder, made from its URI and storage options."""

    _root: Location
    _options: dict[str, Any] | None
    _retry: RetryPolicy | None

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's URI (DCP logs it)."""
        return self._root.uri

    def _reroot(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """DCP's ``reset(checkpoint_id)``: a new URI for the next save or load, when one is given."""
        if checkpoint_id:
            self._root = root_location(checkpoint_id, self._options, self._retry)
