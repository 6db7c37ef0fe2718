"""The ``chunked`` step kind: a deduplicated tree, its files cut into chunks of the directory's chunk store
(:mod:`..dedup` saves, :mod:`..rebuild` restores). The step's folder holds only its manifest, which lists
every entry and the chunks of each file; :meth:`Dedup.collect <taskpoint.manager.dedup.Dedup.collect>` removes
the chunks no manifest names. Its manifest keeps the layout of format version 2."""

from __future__ import annotations

import dataclasses
import functools
import io
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ... import _progress
from ..._progress import Progress
from ...errors import CheckpointCorruptError
from ...format.index import covered, normalize_path
from ...format.records import ObjectRecord, StepManifest
from ...format.subset import PieceFile, open_pieces
from ...format.tree import ChunkedTree, TreeEntry
from ...payloads import Payload
from ..dedup import deduplicable
from ..rebuild import MissingChunk
from ..step_commit import Stored
from ..steps import StepObjects, StepStore
from . import GONE_HOW, Checked, Described, Gone, SaveJob, StepContext, register_step_kind


@dataclass(frozen=True)
class ChunkedStep:
    """The content of a deduplicated step: its tree of entries and their chunks."""

    kind: ClassVar[str] = "chunked"
    tree: ChunkedTree

    def to_json(self) -> dict[str, Any]:
        return {"payload": "", "tree": {"chunk_size": self.tree.chunk_size,
                                        "entries": [entry.to_json() for entry in self.tree.entries]}}


def _tree(manifest: StepManifest) -> ChunkedTree:
    content = manifest.content
    assert isinstance(content, ChunkedStep)
    return content.tree


class ChunkedKind:
    """Deduplicated steps (see the module); saved when the manager has ``dedup=True``."""

    name = ChunkedStep.kind
    helper = False  # the chunks are hashed and uploaded by this process's pool

    def decode(self, body: dict[str, Any]) -> ChunkedStep:
        if body["payload"] != "":
            raise ValueError("a deduplicated step names a payload object")
        raw = body["tree"]
        tree = ChunkedTree(chunk_size=int(raw["chunk_size"]),
                           entries=tuple(TreeEntry.from_json(e) for e in raw["entries"]))
        if tree.chunk_size < 1:
            raise ValueError("the chunk size is not positive")
        return ChunkedStep(tree)

    def accepts(self, payload: Payload | object, context: StepContext) -> bool:
        return context.dedup is not None and isinstance(payload, Payload) and deduplicable(payload)

    def store(self, context: StepContext, job: SaveJob) -> Stored:
        dedup, payload = context.dedup, job.payload
        assert dedup is not None and isinstance(payload, Payload)
        record = ObjectRecord(kind=payload.kind, codec="chunked", save_id=uuid.uuid4().hex, created=time.time())
        job.until_committed.enter_context(dedup.lease())  # its chunks: named by the lease until the commit
        size, digest, tree = dedup.store(payload, job.progress)
        record = dataclasses.replace(record, size=size, sha256=digest)
        return Stored(ChunkedStep(tree), record, sent=dedup.last.uploaded_bytes if dedup.last else size,
                      guard=functools.partial(dedup.commit, tree))

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        try:
            return context.rebuilder.restore(step, _tree(manifest), manifest.record.kind, workspace, progress)
        except MissingChunk as missing:
            raise Gone(f"step {step} in {context.steps.directory} is damaged: {missing} (removed after the "
                       f"commit{GONE_HOW}). Restore an older step (fallback=True), or save it again.") from None

    def restore_paths(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                      paths: Sequence[str], progress: Progress) -> Path:
        """Only the chunks of the files ``paths`` name, each verified by its sha256."""
        tree = _tree(manifest)
        chosen = {e.path for e in tree.entries if covered(e.path, paths) is not None}
        missing = [p for p in paths if not any(covered(c, [p]) for c in chosen)]
        if missing:
            raise KeyError(f"not in step {step} of {context.steps.directory}: {', '.join(map(repr, missing))}")
        above = {"/".join(c.split("/")[:i]) for c in chosen for i in range(1, c.count("/") + 1)}
        subset = ChunkedTree(tree.chunk_size, tuple(e for e in tree.entries
                                                     if e.path in chosen or (e.type == "dir" and e.path in above)))
        return self.restore(context, step, dataclasses.replace(manifest, content=ChunkedStep(subset)), workspace,
                            progress)

    def open_file(self, context: StepContext, step: int, manifest: StepManifest, path: str) -> io.BufferedReader:
        name = normalize_path(path)
        tree = _tree(manifest)
        entry = next((e for e in tree.entries if e.path == name), None)
        if entry is None:
            raise KeyError(f"not in step {step} of {context.steps.directory}: {path!r}")
        if entry.type != "file":
            raise IsADirectoryError(f"{path!r} is a folder of step {step}, not a file") if entry.type == "dir" \
                else ValueError(f"{path!r} is a symlink in step {step}; open the file it points to")
        size, chunks = tree.chunk_size, context.rebuilder.chunks

        def fetch(i: int) -> bytes:
            try:
                return chunks.get(entry.chunks[i], min(size, entry.size - i * size))
            except FileNotFoundError:
                raise CheckpointCorruptError(f"step {step} in {context.steps.directory} is damaged: file {name!r} "
                                             f"needs chunk {chunks.uri(entry.chunks[i])}, which is missing") from None

        raw = PieceFile([i * size for i in range(len(entry.chunks))], fetch, 0, entry.size,
                        f"{context.steps.step_uri(step)}:{name}")
        return open_pieces(raw)

    def verify(self, context: StepContext, step: int, manifest: StepManifest, progress: object) -> Checked:
        tree = _tree(manifest)
        try:
            with _progress.resolve(progress, f"verify step {step}") as tracker:
                total = context.rebuilder.verify(step, tree, tracker)
        except MissingChunk as missing:
            raise FileNotFoundError(str(missing)) from None
        return Checked(total, f"deduplicated: {tree.count('file')} files in {tree.chunk_count()} chunks, each "
                              "matches its sha256")

    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects:
        chunks: dict[str, str] = {}
        for entry in _tree(manifest).entries:
            for key in entry.chunks:
                chunks.setdefault(key, entry.path)
        return StepObjects(chunks=chunks)

    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]:
        return set()  # its chunks go with the sweep of the chunk store, once no manifest names them

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        tree = _tree(manifest)
        return Described(payload="", details={
            "files": tree.count("file"), "folders": tree.count("dir"), "links": tree.count("link"),
            "chunk_size": tree.chunk_size, "chunks": tree.chunk_count(), "unique_chunks": len(tree.chunk_keys())})

    def owns(self, name: str, committed: bool) -> bool:
        return False  # its folder holds only the manifest


CHUNKED = register_step_kind(ChunkedKind())
