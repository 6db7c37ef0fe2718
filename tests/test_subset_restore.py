"""Restoring part of a step or checkpoint (restore(paths=), load_sync(paths=), await load(paths=)): the subset
equals the same files of a full restore, damage inside it is caught and damage outside it is never read, a
missing path raises KeyError naming it, and archives without an index (Flyte's, zstd) restore by streaming."""

from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import anyio
import fsspec
import pytest

from helpers import make_tree, snapshot
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointError, CheckpointManager, UnsafeArchiveError
from taskpoint.format.fileset import PIECE_SIZE
from taskpoint.format.index import ArchiveIndex

LOCAL_S3 = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
#: Bulk large enough for three 4 MiB gzip members: damage in one member leaves the others readable.
BULK = 9_000_000
SUBSET = ["nested/", "state.json", "link-to-notes"]
FLYTE_PYTHON = Path(os.environ.get("TASKPOINT_FLYTE_PYTHON",
                                   Path(__file__).resolve().parents[1] / ".venv-flyte" / "bin" / "python"))


def _selected(tree: dict, paths: list[str]) -> dict:
    names = [p.rstrip("/") for p in paths]
    return {k: v for k, v in tree.items() if any(k == n or k.startswith(n + "/") for n in names)}


def _fs(store):
    return fsspec.core.url_to_fs(store.url("x"), **store.storage_options)[0]


@LOCAL_S3
@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_manager_subset_equals_the_same_files_of_a_full_restore(store, tmp_path, dedup):
    src = make_tree(tmp_path / "src", big=BULK)
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=dedup) as mgr:
        mgr.save(src, 1, blocking=True)
        full = snapshot(mgr.restore(1, into=tmp_path / "full"))
        part = mgr.restore(1, into=tmp_path / "part", paths=SUBSET)
        assert snapshot(part) == _selected(full, SUBSET)
        assert not (part / "bulk.bin").exists()
        with pytest.raises(KeyError, match=r"'no/such\.bin'"):
            mgr.restore(1, into=tmp_path / "none", paths=["state.json", "no/such.bin"])


@LOCAL_S3
@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_checkpoint_subset_equals_the_same_files_of_a_full_load(store, tmp_path, codec):
    src = make_tree(tmp_path / "src", big=BULK)
    Checkpoint(store.url("ckpt"), storage_options=store.storage_options, codec=codec).save_sync(src)
    full = Checkpoint(store.url("next"), store.url("ckpt"), storage_options=store.storage_options)
    expected = _selected(snapshot(full.load_sync()), SUBSET)
    cp = Checkpoint(store.url("next"), store.url("ckpt"), storage_options=store.storage_options)
    assert snapshot(cp.load_sync(paths=SUBSET)) == expected
    other = Checkpoint(store.url("next"), store.url("ckpt"), storage_options=store.storage_options)
    assert snapshot(anyio.run(lambda: other.load(paths=["nested"]))) == _selected(expected, ["nested"])
    with pytest.raises(KeyError, match=r"'missing\.txt'"):
        Checkpoint(store.url("n"), store.url("ckpt"), storage_options=store.storage_options).load_sync(
            paths=["missing.txt"])


def test_gzip_saves_record_an_index_covered_by_the_record_and_manifest_digests(tmp_path):
    src = make_tree(tmp_path / "src", big=BULK)
    Checkpoint(tmp_path / "ckpt").save_sync(src)
    record = json.loads((tmp_path / "ckpt.taskpoint.json").read_text())
    index = ArchiveIndex.from_json(record["objects"][0]["index"])
    assert len(index.members) == 3 and index.stored_size == (tmp_path / "ckpt").stat().st_size
    assert {e.name for e in index.entries} >= {"bulk.bin", "nested/deeper/notes.txt", "link-to-dir"}
    # The index is inside the sealed record: changing one offset of it makes the record damaged.
    text = (tmp_path / "ckpt.taskpoint.json").read_text()
    bulk_data = str(index.entries[0].data)
    (tmp_path / "ckpt.taskpoint.json").write_text(text.replace(f'"f", 0, {bulk_data}', f'"f", 0, {bulk_data}1', 1))
    with pytest.raises(CheckpointCorruptError, match="fails its check"):
        Checkpoint(tmp_path / "n", tmp_path / "ckpt").load_sync(paths=["state.json"])
    with CheckpointManager(tmp_path / "m") as mgr:
        mgr.save(src, 1, blocking=True)
        manifest = json.loads((tmp_path / "m" / "ckpt-1" / "taskpoint.json").read_text())
        assert ArchiveIndex.from_json(manifest["index"]).entries == index.entries


def _flip_in_member(path: Path, index: ArchiveIndex, member: int) -> None:
    span = index.span(member)
    with open(path, "r+b") as f:
        f.seek(span.stored + span.stored_length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_damage_inside_the_subset_is_caught_and_outside_it_is_not_read(tmp_path):
    src = make_tree(tmp_path / "src", big=BULK)  # bulk.bin fills members 0 and 1; the rest lies in member 2
    Checkpoint(tmp_path / "ckpt").save_sync(src)
    index = ArchiveIndex.from_json(json.loads((tmp_path / "ckpt.taskpoint.json").read_text())["objects"][0]["index"])
    assert index.spans(index.entries[0].data, index.entries[0].end)[-1].index == 2  # its tail shares member 2
    _flip_in_member(tmp_path / "ckpt", index, 0)
    part = Checkpoint(tmp_path / "n", tmp_path / "ckpt").load_sync(paths=SUBSET)
    assert snapshot(part) == _selected(snapshot(src), SUBSET)
    with pytest.raises(CheckpointCorruptError, match="member 0"):
        Checkpoint(tmp_path / "n2", tmp_path / "ckpt").load_sync(paths=["bulk.bin"])


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_manager_damage_inside_the_subset_raises_and_outside_does_not(tmp_path, dedup):
    # A payload step is checked by its 16 MiB BLAKE3 pieces: the bulk (first in the archive) reaches past the first
    # piece, so that the subset lies in another piece than the damage.
    src = make_tree(tmp_path / "src", big=BULK if dedup else PIECE_SIZE + BULK)
    with CheckpointManager(tmp_path / "m", dedup=dedup) as mgr:
        mgr.save(src, 1, blocking=True)
        manifest = json.loads((tmp_path / "m" / "ckpt-1" / "taskpoint.json").read_text())
        if dedup:
            bulk = next(e for e in manifest["tree"]["entries"] if e["path"] == "bulk.bin")
            key = bulk["chunks"][0]
            (tmp_path / "m" / "chunks" / key[:2] / key).write_bytes(b"not the chunk")
        else:
            index = ArchiveIndex.from_json(manifest["index"])
            _flip_in_member(tmp_path / "m" / "ckpt-1" / manifest["content"]["payload"], index, 0)
        part = mgr.restore(1, into=tmp_path / "part", paths=SUBSET)
        assert snapshot(part) == _selected(snapshot(src), SUBSET)
        with pytest.raises(CheckpointCorruptError, match=r"step 1|member 0"):
            mgr.restore(1, into=tmp_path / "bad", paths=["bulk.bin"])
        assert not (tmp_path / "bad" / "bulk.bin").exists()


def test_a_bytes_step_has_no_paths_and_a_bad_path_is_refused(tmp_path):
    with CheckpointManager(tmp_path / "m") as mgr:
        mgr.save(b"abc", 1, blocking=True)
        with pytest.raises(ValueError, match="not a directory"):
            mgr.restore(1, paths=["payload"])
        with pytest.raises(ValueError, match="not a path inside"):
            mgr.restore(1, paths=["../etc"])
        with pytest.raises(TypeError, match="list"):
            mgr.restore(1, paths="model/")


def test_a_step_kind_without_partial_reads_is_refused_with_a_clear_error(monkeypatch):
    """The tests' ``notes`` plug-in reads no part of a step (a ``sharded`` step did not either, before a step of
    several ranks handed each rank's part to its kind: see the test below)."""
    from taskpoint.manager.kinds import KINDS, partial_kind, step_kind

    monkeypatch.syspath_prepend(str(Path(__file__).with_name("kinds_plugin")))
    try:
        importlib.import_module("notes_kind")
        with pytest.raises(CheckpointError, match="kind 'notes' cannot be read in part"):
            partial_kind(step_kind("notes"))
    finally:
        KINDS._kinds.pop("notes", None)
        sys.modules.pop("notes_kind", None)
    assert partial_kind(step_kind("chunked")) is step_kind("chunked")


def test_a_step_of_several_ranks_reads_this_ranks_directory_in_part(tmp_path):
    """Each rank's part of a ``sharded`` step is read as its kind reads a step of one rank: a directory through
    its archive's index (rank 1 saves from a thread, as a second process would)."""
    trees = [make_tree(tmp_path / f"src-{rank}") for rank in range(2)]
    (trees[1] / "state.json").write_text('{"step": 8}')
    options = {"world_size": 2, "commit_timeout": 60, "grace_seconds": 120, "preemption": False}
    with CheckpointManager(tmp_path / "ckpts", rank=0, **options) as zero, \
            CheckpointManager(tmp_path / "ckpts", rank=1, **options) as one:
        other = threading.Thread(target=one.save, args=(trees[1], 1))
        other.start()
        zero.save(trees[0], 1)
        other.join(120)
        assert not other.is_alive() and zero.describe(1).kind == "sharded"
        for rank, manager in enumerate((zero, one)):
            part = manager.restore(1, into=tmp_path / f"part-{rank}", paths=["state.json"])
            assert sorted(p.name for p in part.iterdir()) == ["state.json"]
            assert (part / "state.json").read_text() == (trees[rank] / "state.json").read_text()


def test_a_subset_restore_counts_the_members_it_reads_as_its_progress(tmp_path):
    src = make_tree(tmp_path / "src", big=BULK)
    Checkpoint(tmp_path / "ckpt").save_sync(src)
    record = json.loads((tmp_path / "ckpt.taskpoint.json").read_text())["objects"][0]
    index = ArchiveIndex.from_json(record["index"])
    seen: list[tuple[str, int]] = []

    class Recorder(fsspec.callbacks.Callback):
        def set_size(self, size):
            seen.append(("total", size))

        def relative_update(self, inc=1):
            seen.append(("update", inc))

    Checkpoint(tmp_path / "n", tmp_path / "ckpt").load_sync(paths=["state.json"], progress=Recorder())
    last = index.span(len(index.members) - 1)
    assert ("total", last.stored_length) in seen  # state.json lies in the last member alone
    assert sum(n for what, n in seen if what == "update") == last.stored_length < record["size"] / 2


def test_a_hostile_archive_without_an_index_is_refused_by_a_subset_load(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in (("ok.txt", b"fine"), ("a/../../evil.txt", b"escaped")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "hostile").write_bytes(buf.getvalue())
    cp = Checkpoint(tmp_path / "n", tmp_path / "hostile", workspace=tmp_path / "ws" / "inner")
    with pytest.raises(UnsafeArchiveError):
        cp.load_sync(paths=["ok.txt"])
    assert not (tmp_path / "ws" / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()


@pytest.mark.skipif(not FLYTE_PYTHON.exists(), reason="no flyte venv; `make test` creates it")
def test_a_checkpoint_written_by_flyte_restores_a_subset_by_streaming(tmp_path):
    src = make_tree(tmp_path / "src", big=BULK)
    script = Path(__file__).with_name("compat") / "flyte_side.py"
    out = subprocess.run([str(FLYTE_PYTHON), str(script), "save", str(tmp_path / "ckpt"), "path", str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp_path / "ckpt.taskpoint.json").exists()  # no record, so no index: streamed
    cp = Checkpoint(tmp_path / "n", tmp_path / "ckpt")
    assert snapshot(cp.load_sync(paths=SUBSET)) == _selected(snapshot(src), SUBSET)
    with pytest.raises(KeyError, match="'nothing'"):
        Checkpoint(tmp_path / "n2", tmp_path / "ckpt").load_sync(paths=["nothing"])
    with Checkpoint(tmp_path / "n3", tmp_path / "ckpt").open("nested/run.sh") as f:
        assert f.read() == (src / "nested" / "run.sh").read_bytes()


def test_an_index_that_lies_about_a_hostile_archive_cannot_escape_the_workspace(tmp_path):
    # A record whose (sealed) index names the entry "ok/evil.txt" over an archive whose member there is
    # "../evil.txt": the members read go through the same extraction checks as a full load.
    from taskpoint.format.pgzip import ParallelGzipWriter, crc32
    from taskpoint.format.records import ObjectRecord, Record

    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("../evil.txt")
        info.size = 7
        tar.addfile(info, io.BytesIO(b"escaped"))
    stored = io.BytesIO()
    writer = ParallelGzipWriter(stored)
    writer.write(plain.getvalue())
    writer.close()
    blob = stored.getvalue()
    (tmp_path / "ckpt").write_bytes(blob)
    index = ArchiveIndex.from_json({"codec": "gzip", "members": [list(m) for m in writer.written],
                                    "entries": [["ok/evil.txt", "f", 0, 512, 7, ""]]})
    entry = ObjectRecord(kind="directory", codec="gzip", save_id="s", created=0.0, size=len(blob),
                         crc32=f"{crc32(blob, 0) & 0xFFFFFFFF:08x}", index=index)
    (tmp_path / "ckpt.taskpoint.json").write_bytes(Record(objects=(entry,), confirmed="s").to_bytes())
    cp = Checkpoint(tmp_path / "n", tmp_path / "ckpt", workspace=tmp_path / "ws" / "inner")
    with pytest.raises(UnsafeArchiveError, match=r"'\.\.' in its path"):
        cp.load_sync(paths=["ok"])
    assert not (tmp_path / "ws" / "evil.txt").exists() and not (tmp_path / "ws" / "inner" / "ok").exists()
