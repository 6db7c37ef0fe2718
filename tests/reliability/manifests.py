"""Manifest damage (issue 21 item 3): one bit flipped, or one byte replaced, anywhere in a manifest or a record.

Each trial damages one document of a store built once and copied afresh for the trial, then reads it the way
taskpoint does. Every trial must end in one of three ways: the damage is detected (CheckpointCorruptError, or
for a rank's record a step that rank 0 abandons), a restore with ``fallback=True`` falls back to the older step,
or what comes back is exactly what was saved (a flip that changes no value, such as the case of a ``\\u``
escape). Anything else is a *silently wrong* result, and any other exception a failure too.

The documents, taken in turn:

- ``plain``, ``dedup``, ``ranks``: the manifest of step 2 of a CheckpointManager directory (one payload,
  version 1; a deduplicated tree, version 2; two ranks' shards, version 3) beside an intact step 1, each step
  a folder with an executable script, a data file and a subfolder, and metadata. A trial restores step 2,
  restores with ``fallback=True`` (from every rank), reads ``metadata(2)``, then runs ``gc(grace_seconds=0)``:
  it must remove nothing that the intact manifests name, and nothing at all when the damage was detected (the
  store holds a leftover payload, and for ``dedup`` a chunk of a deleted step, that gc removes otherwise).
- ``record``: the record beside a single ``Checkpoint`` (``<dest>.taskpoint.json``), then a load.
- ``rank-record``: rank 1's record of its shard before rank 0 commits: rank 0 then saves its own shard (it
  must commit a step both ranks restore intact, or abandon it, or the restore must raise).
- ``fileset``: the file-set manifest of a DCP step (``taskpoint.torch``), parsed as its reader parses it.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from helpers import snapshot
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointManager, StepAbandonedError
from taskpoint.format.fileset import FileEntry, FileSetManifest

from ._common import Result, Servers, describe_exception, list_objects, remove_location, timed

KINDS = ("plain", "dedup", "ranks", "record", "rank-record", "fileset")
#: The share of trials that replace a byte with another value; the others flip one bit of it.
REPLACED_SHARE = 1 / 3
#: The metadata of every step (the issue's finding turned ``lr`` 0.001 into 0.011 and ``epoch`` into ``epokh``).
METADATA = {"lr": 0.001, "epoch": 3, "note": "café"}
MANIFEST = "taskpoint.json"
RANK_TIMEOUT = 0.2  # seconds rank 0 waits for a rank's record before abandoning the step
RANK_GRACE = 1.0  # must exceed RANK_TIMEOUT


def damage(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """``data`` with one bit flipped or one byte replaced at a random position; and what was done."""
    at = rng.randrange(len(data))
    if rng.random() < REPLACED_SHARE:
        value = rng.choice([b for b in range(256) if b != data[at]])
        what = f"byte {at} {data[at]:#04x} -> {value:#04x}"
    else:
        bit = rng.randrange(8)
        value = data[at] ^ (1 << bit)
        what = f"bit {bit} of byte {at}"
    return data[:at] + bytes([value]) + data[at + 1:], what


def write_folder(root: Path, version: int) -> Path:
    """A small folder whose every property a restore must keep: names, modes, bytes, a subfolder."""
    (root / "sub").mkdir(parents=True)
    (root / "run.sh").write_text(f"#!/bin/sh\necho {version}\n")
    os.chmod(root / "run.sh", 0o755)
    (root / "data.bin").write_bytes(random.Random(version).randbytes(3000))
    (root / "sub" / "notes.txt").write_text("shared by every version\n")
    os.chmod(root / "sub" / "notes.txt", 0o640)
    return root


@dataclass
class Tally:
    """What the trials of one kind of document came to."""

    trials: int = 0
    raised: int = 0
    fell_back: int = 0
    equal: int = 0
    wrong: int = 0
    failed: int = 0

    def line(self, kind: str) -> str:
        fell = f" (fell back {self.fell_back})" if kind in ("plain", "dedup", "ranks") else ""
        failed = f", other failures {self.failed}" if self.failed else ""
        return f"{kind} {self.trials}: raised {self.raised}{fell}, equal {self.equal}, wrong {self.wrong}{failed}"


class Wrong(Exception):
    """A trial returned something other than what was saved: a silently wrong result."""


class Store:
    """Pristine stores built once on local disk, copied to a fresh place for each trial."""

    def __init__(self, servers: Servers, kind: str, scratch: Path) -> None:
        self.servers, self.kind, self.scratch = servers, kind, scratch
        self.pristine: dict[str, Path] = {}

    @contextlib.contextmanager
    def copy(self, name: str) -> Iterator[Any]:
        """A fresh place on this store holding a copy of pristine store ``name``."""
        place = self.servers.location(self.kind, self.scratch / "trials")
        source = self.pristine[name]
        try:
            if place.kind == "local":
                shutil.copytree(source, place.base, dirs_exist_ok=True, copy_function=shutil.copy)
            else:
                fs = fsspec.filesystem(place.protocol, **place.fs_options)
                fs.pipe({place.url(str(p.relative_to(source))): p.read_bytes()
                         for p in sorted(source.rglob("*")) if p.is_file()})
            yield place
        finally:
            remove_location(place)


def _read(place: Any, relative: str) -> bytes:
    with fsspec.open(place.url(relative), "rb", **place.fs_options) as f:
        return f.read()  # type: ignore[no-any-return]


def _write(place: Any, relative: str, data: bytes) -> None:
    fs, path = fsspec.core.url_to_fs(place.url(relative), **place.fs_options)
    fs.pipe_file(path, data)
    fs.invalidate_cache()


# -- building the pristine stores -----------------------------------------------------------------------------


def _manager(url: str, rank: int | None = None, **kwargs: Any) -> CheckpointManager:
    ranks = {} if rank is None else {"rank": rank, "world_size": 2}
    return CheckpointManager(url, preemption=False, **ranks, **kwargs)


def build(scratch: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """The pristine stores (local folders) and what each trial must get back from them."""
    sources = scratch / "sources"
    folders = {(rank, step): write_folder(sources / f"r{rank}-s{step}", 10 * rank + step)
               for rank in (0, 1) for step in (0, 1, 2)}
    expected = {(rank, step): snapshot(folder) for (rank, step), folder in folders.items()}
    stores: dict[str, Path] = {}
    for kind in ("plain", "dedup"):
        root = stores[kind] = scratch / "pristine" / kind
        with _manager(str(root), dedup=kind == "dedup") as mgr:
            for step in (0, 1, 2):
                mgr.save(folders[0, step], step, metadata=METADATA)
            mgr.delete(0)  # deduplicated: step 0's own chunks stay, unnamed, until gc
        if kind == "plain":  # a superseded save's payload beside step 2's: gc removes it once it can tell
            (root / "ckpt-2" / f"payload-{'0' * 32}").write_bytes(b"left over")
    root = stores["ranks"] = scratch / "pristine" / "ranks"
    with _manager(str(root), 0) as rank0, _manager(str(root), 1) as rank1:
        for step in (1, 2):
            other = threading.Thread(target=rank1.save, args=(folders[1, step], step))
            other.start()
            rank0.save(folders[0, step], step, metadata=METADATA)
            other.join()
    (root / "ckpt-2" / f"payload-{'0' * 32}").write_bytes(b"left over")
    root = stores["record"] = scratch / "pristine" / "record"
    Checkpoint(root / "ckpt").save_sync(folders[0, 2])
    root = stores["rank-record"] = scratch / "pristine" / "rank-record"
    with _manager(str(root), 1, grace_seconds=RANK_GRACE, commit_timeout=RANK_TIMEOUT) as rank1:
        rank1.save(folders[1, 2], 1)  # returns once its shard and record are stored
    return stores, {"folders": folders, "snapshots": expected}


def _fileset() -> FileSetManifest:
    files = {f"__{r}_0-{'ab12' * 3}.distcp": FileEntry(size=1000 + r, sha256=f"{r:064x}") for r in range(2)}
    files[".metadata"] = FileEntry(size=321, sha256="f" * 64)
    return FileSetManifest(kind="torch.dcp", save_id="0" * 32, created=1796180000.25, files=files, attempt=2,
                           metadata=METADATA)


# -- one trial of each kind -----------------------------------------------------------------------------------


def _step_trial(store: Store, kind: str, rng: random.Random, expected: dict[str, Any]) -> str:
    snaps = expected["snapshots"]
    ranks = (0, 1) if kind == "ranks" else (None,)
    with store.copy(kind) as place:
        before = set(list_objects(place))
        named = before - {f"ckpt-2/payload-{'0' * 32}"} - {o for o in before if o.startswith("chunks/")
                                                           and not _named_chunk(place, o)}
        data, what = damage(_read(place, f"ckpt-2/{MANIFEST}"), rng)
        _write(place, f"ckpt-2/{MANIFEST}", data)
        outcomes = set()
        for rank in ranks:
            with _manager(place.base, rank, storage_options=place.storage_options) as mgr:
                mine = snaps[rank or 0, 2]
                try:
                    got = snapshot(mgr.restore(2))
                    if got != mine:
                        raise Wrong(f"restore(2) returned other files ({what})")
                    outcomes.add("equal")
                except CheckpointCorruptError:
                    outcomes.add("raised")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = snapshot(mgr.restore(fallback=True))
                chosen = mgr.restored_step
                if chosen not in (1, 2) or got != snaps[rank or 0, chosen]:
                    raise Wrong(f"restore(fallback=True) returned other files than step {chosen}'s ({what})")
                outcomes.add("fell back" if chosen == 1 else "equal")
                try:
                    if mgr.metadata(2) != METADATA:
                        raise Wrong(f"metadata(2) is {mgr.metadata(2)!r} ({what})")
                    outcomes.add("equal")
                except CheckpointCorruptError:
                    outcomes.add("raised")
        with _manager(place.base, ranks[0], storage_options=place.storage_options) as mgr:
            removed = mgr.gc(grace_seconds=0)
        lost = named - set(list_objects(place))
        if lost:
            raise Wrong(f"gc(grace_seconds=0) removed {sorted(lost)}, which intact manifests name ({what})")
        if outcomes in ({"raised", "fell back"}, {"equal"}):
            if "raised" in outcomes and removed:
                raise Wrong(f"gc(grace_seconds=0) removed {removed} on the word of a damaged manifest ({what})")
            return "raised" if "raised" in outcomes else "equal"
        raise AssertionError(f"inconsistent outcomes {sorted(outcomes)} ({what})")


def _named_chunk(place: Any, relative: str) -> bool:
    """Whether an intact manifest (steps 1 and 2) names the chunk at ``relative`` (``chunks/xx/<key>``)."""
    key = relative.rsplit("/", 1)[-1]
    return any(key in _read(place, f"ckpt-{step}/{MANIFEST}").decode() for step in (1, 2))


def _record_trial(store: Store, rng: random.Random, expected: dict[str, Any]) -> str:
    with store.copy("record") as place:
        data, what = damage(_read(place, "ckpt.taskpoint.json"), rng)
        _write(place, "ckpt.taskpoint.json", data)
        with Checkpoint(place.url("next"), place.url("ckpt"), storage_options=place.storage_options) as cp:
            try:
                loaded = cp.load_sync()
            except CheckpointCorruptError:
                return "raised"
            if loaded is None or snapshot(loaded) != expected["snapshots"][0, 2]:
                raise Wrong(f"the load returned other files ({what})")
        return "equal"


def _rank_record_trial(store: Store, rng: random.Random, expected: dict[str, Any]) -> str:
    with store.copy("rank-record") as place:
        data, what = damage(_read(place, "ckpt-1/rank-1.json"), rng)
        _write(place, "ckpt-1/rank-1.json", data)
        options = {"storage_options": place.storage_options, "grace_seconds": RANK_GRACE,
                   "commit_timeout": RANK_TIMEOUT}
        with _manager(place.base, 0, **options) as rank0:
            try:
                rank0.save(expected["folders"][0, 2], 1)
            except StepAbandonedError:
                return "raised"
        for rank in (0, 1):
            with _manager(place.base, rank, **options) as mgr:
                try:
                    got = snapshot(mgr.restore(1))
                except CheckpointCorruptError:
                    return "raised"
                if got != expected["snapshots"][rank, 2]:
                    raise Wrong(f"rank {rank} restored other files ({what})")
        return "equal"


def _fileset_trial(rng: random.Random) -> str:
    original = _fileset()
    data, what = damage(original.to_bytes(), rng)
    try:
        parsed = FileSetManifest.from_bytes(data, "memory://fileset")
    except CheckpointCorruptError:
        return "raised"
    if parsed != original:
        raise Wrong(f"the file-set manifest parsed as another ({what})")
    return "equal"


def _trial(kind: str, store: Store, rng: random.Random, expected: dict[str, Any]) -> str:
    """One trial of ``kind``: ``raised`` (the damage was detected) or ``equal``; Wrong when silently wrong."""
    if kind == "record":
        return _record_trial(store, rng, expected)
    if kind == "rank-record":
        return _rank_record_trial(store, rng, expected)
    if kind == "fileset":
        return _fileset_trial(rng)
    return _step_trial(store, kind, rng, expected)


# -- the row ------------------------------------------------------------------------------------------------


def run(servers: Servers, counts: dict[str, int], rng: random.Random, scratch: Path) -> list[Result]:
    """One row per store: ``counts[store]`` trials, going round :data:`KINDS`."""
    stores, expected = build(scratch / "build")
    results = []
    for kind, count in counts.items():
        result = Result("Manifest damage: one bit or byte of a manifest or record", kind)
        tallies = {name: Tally() for name in KINDS}
        store = Store(servers, kind, scratch / kind)
        store.pristine = stores
        with timed(result):
            for n in range(count):
                name = KINDS[n % len(KINDS)]
                tally = tallies[name]
                tally.trials += 1
                try:
                    outcome = _trial(name, store, rng, expected)
                except Wrong as exc:
                    tally.wrong += 1
                    result.trial(f"{name}: silently wrong: {exc}")
                    continue
                except Exception as exc:
                    tally.failed += 1
                    result.trial(f"{name}: {describe_exception(exc)}")
                    continue
                if outcome == "raised":
                    tally.raised += 1
                    tally.fell_back += name in ("plain", "dedup", "ranks")
                else:
                    tally.equal += 1
                result.trial()
        total = sum((Counter(vars(t)) for t in tallies.values()), Counter())
        result.note(f"raised {total['raised']} (fell back {total['fell_back']}), equal {total['equal']}, "
                    f"silently wrong {total['wrong']}")
        result.note("; ".join(tallies[name].line(name) for name in KINDS if tallies[name].trials))
        result.figures = {name: vars(tally) for name, tally in tallies.items() if tally.trials}
        results.append(result)
    return results
