"""``taskpoint verify``: stream every stored byte through its recorded checksum, extracting nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import click

from .. import _progress
from .._log import short_name
from ..errors import CheckpointCorruptError, CheckpointError
from ..format.codecs import Codec
from ..format.records import MANIFEST_SUFFIX, ObjectRecord, Record, StepManifest
from ..manager.chunks import ChunkStore
from ..manager.dedup import WORKERS
from ..manager.rebuild import MissingChunk, Rebuilder
from ..manager.steps import StepStore
from ..payloads import Payload
from ..record import load_object, read_record
from ..storage import WRITE_PIECE, Location, digest_by_reading
from ..transfer import DIGESTS, read_payload
from ._app import OK, _command, _Missing, cli, progress_option
from .views import UNCHECKED, _human, _location, _object_size, _steps, fileset_files


class _Discard(Payload):
    """Reads the stored bytes through taskpoint's reader (hashing them) and keeps none: verification only."""

    kind = "verify"
    archived = False

    @classmethod
    def claim(cls, data: object) -> Payload | None:
        return None

    def write(self, sink: IO[bytes], codec: Codec, level: int | None) -> None:  # pragma: no cover - never saved
        raise NotImplementedError

    @classmethod
    def materialize(cls, source: IO[bytes], staging: Path, uri: str) -> None:
        while source.read(WRITE_PIECE):
            pass

    @classmethod
    def publish(cls, staging: Path, workspace: Path) -> Path:
        return workspace


def _stream_check(loc: Location, digest: str, size_hint: int | None, check: Callable[[int, str], None],
                  progress: bool | None, label: str) -> int:
    """Stream the object at ``loc`` and hash every byte (on local disk by positional reads, elsewhere through
    taskpoint's reader with its parallel ranged reads); ``check(size, hexdigest)`` decides. Returns the size.
    Nothing is extracted or kept. ``progress``: the ``--progress`` option (counts the stored bytes)."""
    with _progress.resolve(progress, label) as tracker:
        return _check_stream(loc, digest, size_hint, check, tracker)


def _check_stream(loc: Location, digest: str, size_hint: int | None, check: Callable[[int, str], None],
                  progress: _progress.Progress) -> int:
    seen: list[int] = []

    def verify(kind: str, size: int, hexdigest: str) -> None:
        check(size, hexdigest)
        seen.append(size)

    if loc.is_local:
        def local() -> None:
            progress.restart()
            with loc.open_read() as raw:
                fd = raw.fileno()
                size = os.fstat(fd).st_size
                progress.set_total(size)
                hasher = DIGESTS[digest]()
                hashed = digest_by_reading(fd, size, hasher, progress.update if progress.active else None)
                verify("", hashed, str(hasher.hexdigest()))

        try:
            loc.run(local, action="verify")
        except FileNotFoundError:
            raise _Missing(f"{loc.uri} does not exist") from None
        return seen[-1]
    scratch = Path(tempfile.mkdtemp(prefix="taskpoint-verify-"))
    try:
        found = read_payload(loc, scratch, lambda head, size: _Discard, verify, digest, size_hint=size_hint,
                             progress=progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if found is None:
        raise _Missing(f"{loc.uri} does not exist")
    return seen[-1]


def _verify_checkpoint(loc: Location, progress: bool | None) -> str:
    """Check a checkpoint object against its record; the line to print. CheckpointCorruptError when damaged."""
    record = read_record(loc.sibling(MANIFEST_SUFFIX))
    if record is None or not record.objects:
        if _object_size(loc) is None:
            raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
        # No digest to compare with (Flyte's object, or an older taskpoint's pending save): a full load into
        # a temporary folder runs the archive's own checks.
        scratch = Path(tempfile.mkdtemp(prefix="taskpoint-verify-"))
        try:
            with _progress.resolve(progress, f"verify {short_name(loc.uri)}") as tracker:
                load_object(loc, scratch, tracker)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return f"{loc.uri}: readable (no recorded checksum: checked by loading it, with the archive's own checks)"
    newest = record.of_size(None)
    assert newest is not None
    digest = "sha256" if newest.crc32 is None and newest.sha256 else "crc32"

    def check(size: int, hexdigest: str) -> None:
        if not _matches(record, size, hexdigest):
            sizes = ", ".join(str(o.size) for o in record.objects)
            raise CheckpointCorruptError(f"{loc.uri} is damaged: {size} bytes that match no checksum its record "
                                         f"lists (recorded sizes {sizes})")

    try:
        size = _stream_check(loc, digest, newest.size, check, progress, f"verify {short_name(loc.uri)}")
    except _Missing:
        raise CheckpointCorruptError(f"{loc.uri} is recorded as saved but its object is missing") from None
    return f"{loc.uri}: healthy ({_human(size)}, {digest} matches its record)"


def _matches(record: Record, size: int, hexdigest: str) -> bool:
    return any(record.matching(kind, size, hexdigest) is not None for kind in {o.kind for o in record.objects})


class _ChangedMeanwhile(CheckpointError):
    """The step was deleted or overwritten (by another writer, or by its retention) between the read of its
    manifest and the end of the check: an error (exit 1), not damage, and not "no such step"."""

    def __init__(self, steps: StepStore, step: int) -> None:
        super().__init__(f"step {step} in {steps.directory} was overwritten or deleted while it was verified; "
                         "verify it again")


def _verify_step(steps: StepStore, step: int, progress: bool | None, *, listed: bool = False) -> str:
    """Check one step against its manifest; the line to print. ``listed``: the step was listed as committed,
    so a manifest gone by now was deleted meanwhile (:class:`_ChangedMeanwhile`), not never there."""
    manifest = steps.manifest(step)
    if manifest is None:
        if listed:
            raise _ChangedMeanwhile(steps, step)
        raise _Missing(f"step {step} does not exist in {steps.directory}")
    return _verify_manifest(steps, step, manifest, progress)


def _verify_manifest(steps: StepStore, step: int, manifest: StepManifest, progress: bool | None) -> str:
    """Check the save ``manifest`` commits as ``step``. Damage is reported only when the manifest, read again,
    still commits that save; otherwise :class:`_ChangedMeanwhile`."""
    try:
        return _check_step(steps, step, manifest, progress)
    except (CheckpointCorruptError, _Missing, FileNotFoundError) as exc:
        # A retention or an overwrite deletes the manifest first, then the objects it names: what is missing
        # or short is damage only if the step is still the save that was read.
        if not manifest.same_save(steps.manifest(step, tolerate_corrupt=True)):
            raise _ChangedMeanwhile(steps, step) from None
        if isinstance(exc, CheckpointCorruptError):
            raise
        raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: {exc}") from None


def _check_step(steps: StepStore, step: int, manifest: StepManifest, progress: bool | None) -> str:
    if manifest.tree is not None:
        return _verify_chunked_step(steps, step, manifest, progress)
    parts = ([(s.payload, s.record) for s in manifest.shards] if manifest.shards is not None
             else [(manifest.payload, manifest.record)])
    listed = fileset_files(steps, step, manifest)
    if listed is not None:  # a DCP step (taskpoint.torch): its manifest, then every file it lists
        parts += [(name, ObjectRecord(kind="file", codec="raw", save_id="", created=0.0, size=entry.size,
                                      sha256=entry.sha256)) for name, entry in sorted(listed.items())]
    total = 0
    for name, record in parts:  # every rank's shard of a step of several ranks
        def check(size: int, hexdigest: str, record: ObjectRecord = record, name: str = name) -> None:
            if (size, hexdigest) != (record.size, record.sha256):
                raise CheckpointCorruptError(
                    f"step {step} in {steps.directory} is damaged: read {size} bytes of {name} that do not match "
                    f"the sha256 of its manifest (recorded size {record.size})")

        try:
            total += _stream_check(steps.object(step, name), "sha256", record.size, check, progress,
                                   f"verify step {step}" if len(parts) == 1 else f"verify step {step}: {name}")
        except (_Missing, FileNotFoundError):  # FileNotFoundError: deleted under a streaming read (object stores)
            raise _Missing(f"its payload {name} is missing") from None
    if listed is not None:  # the data the step holds, as ls shows it: its files, not the manifest of them
        total = sum(entry.size for entry in listed.values())
    shards = (f", {len(parts)} shards" if manifest.shards is not None else
              f", {len(listed)} files" if listed is not None else "")
    return f"step {step}: healthy ({_human(total)}{shards}, sha256 matches its manifest){_unchecked(manifest)}"


def _unchecked(manifest: StepManifest) -> str:
    """What a healthy step's line adds when its manifest carries no check of its own."""
    return "" if manifest.checked else f"; {UNCHECKED}"


def _verify_chunked_step(steps: StepStore, step: int, manifest: StepManifest, progress: bool | None) -> str:
    """A deduplicated step: every chunk its tree names fetched and checked against its sha256, as a restore
    checks them (in parallel), with nothing written. A missing chunk is :class:`_Missing` (the caller tells
    damage from a step changed meanwhile)."""
    assert manifest.tree is not None
    rebuilder = Rebuilder(steps, ChunkStore(steps.root, "zstd", None), WORKERS)
    try:
        with _progress.resolve(progress, f"verify step {step}") as tracker:
            total = rebuilder.verify(step, manifest, tracker)
    except MissingChunk as missing:
        raise _Missing(str(missing)) from None
    tree = manifest.tree
    return (f"step {step}: healthy ({_human(total)}, deduplicated: {tree.count('file')} files in "
            f"{tree.chunk_count()} chunks, each matches its sha256){_unchecked(manifest)}")


@cli.command("verify")
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="check only this step of a manager directory (default: every committed step)")
@progress_option
@_command
def verify_command(uri: str, step: int | None, progress: bool | None) -> int:
    """Stream every byte of a checkpoint (or of a manager's steps) and check it against its recorded checksum.

    Nothing is extracted: the stored bytes are hashed as they stream. Exit code 0 healthy, 1 error (storage,
    usage, a step overwritten or deleted while it was verified), 2 damaged (the object or step is named), 3 not
    found.

    \b
    Examples:
      taskpoint verify ./.taskpoint/job7/train/3/checkpoint
      taskpoint verify s3://bucket/runs/steps --step 1200 && echo intact
    """
    loc = _location(uri)
    started = time.perf_counter()
    if step is None and (read_record(loc.sibling(MANIFEST_SUFFIX)) is not None or _object_size(loc) is not None):
        click.echo(_verify_checkpoint(loc, progress))
        return OK
    steps = _steps(loc)
    if step is not None:
        click.echo(_verify_step(steps, step, progress))
        return OK
    committed = sorted(n for n, folder in steps.scan().items() if folder.committed)
    if not committed:
        raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
    _verify_steps(steps, committed, progress)
    click.echo(f"{loc.uri}: {len(committed)} step(s) healthy in {time.perf_counter() - started:.2f} s")
    return OK


def _verify_steps(steps: StepStore, committed: list[int], progress: bool | None) -> None:
    """Check each of the ``committed`` steps a listing found, printing a line for each. CheckpointCorruptError
    when any is damaged; else CheckpointError when any was overwritten or deleted after the listing (another
    writer, or its retention), each of them said on its line."""
    damaged, changed = [], []
    for number in committed:
        try:
            click.echo(_verify_step(steps, number, progress, listed=True))
        except CheckpointCorruptError as exc:
            damaged.append(number)
            click.echo(f"step {number}: DAMAGED: {' '.join(str(exc).split())}")
        except _ChangedMeanwhile:
            changed.append(number)
            click.echo(f"step {number}: not checked: overwritten or deleted while it was verified")
    if damaged:
        raise CheckpointCorruptError(f"{len(damaged)} of {len(committed)} step(s) in {steps.directory} are damaged: "
                                     f"{', '.join(map(str, damaged))}")
    if changed:
        raise CheckpointError(f"{len(changed)} of {len(committed)} step(s) in {steps.directory} were overwritten or "
                              f"deleted while they were verified (another writer, or its retention): "
                              f"{', '.join(map(str, changed))}; verify again")


# -- pull and push --------------------------------------------------------------------------------------------


