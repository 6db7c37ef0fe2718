"""PyTree steps of CheckpointManager as Orbax's own files (the ``jax.pytree`` step kind), with real jax and
orbax-checkpoint on the CPU: what they hold, what a restore verifies, and how retention, delete and gc treat them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import blake3
import fsspec
import numpy as np
import pytest

from helpers import LazyModule, flip_byte_at, requires
from taskpoint import CheckpointCorruptError, CheckpointError, CheckpointManager
from taskpoint.format import fileset
from taskpoint.format.sealing import sealed

pytestmark = requires("jax", "orbax.checkpoint")

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")
tpjax = LazyModule("taskpoint.jax")
pytree_kind = LazyModule("taskpoint.jax._kind")
pytree_load = LazyModule("taskpoint.jax._load")


def tree(seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.normal(size=(64, 32)).astype(np.float32)),
                       "b": rng.normal(size=32).astype(np.float64)},
            "step": seed, "name": f"run-{seed}", "key": jax.random.key(seed)}


def assert_same(actual: dict[str, object], expected: dict[str, object]) -> None:
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, b in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True):
        if isinstance(b, jax.Array) and jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def tree_folder(directory: Path, step: int) -> Path:
    (found,) = [p for p in (directory / f"ckpt-{step}").iterdir() if p.is_dir()]
    return found


def largest_file(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_a_pytree_step_holds_orbaxs_files_hashed_and_restores_the_same_tree(store):
    with CheckpointManager(store.url("steps"), storage_options=store.storage_options) as m:
        m.save(tpjax.PyTree(tree(1)), 1, metadata={"epoch": 1})
        described = m.describe(1)
        assert (described.kind, described.codec, m.metadata(1)) == ("jax.pytree", "files", {"epoch": 1})
        assert described.details["files"] > 2  # the sidecar and Orbax's files, each listed with its sha256
        assert_same(tpjax.load_pytree_sync(m, target=tree(0), step=1), tree(1))
        assert sorted(p.name for p in m.restore(1).iterdir()) == ["orbax", "taskpoint-pytree.json"]
        assert m.verify(1).steps[0].state == "healthy"
        assert [s.state for s in m.inventory()] == ["committed"]


def test_on_local_disk_orbax_writes_into_the_step_and_no_archive_is_made(tmp_path):
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(tpjax.PyTree(tree(1)), 1)
    names = sorted(p.name for p in (tmp_path / "steps" / "ckpt-1").iterdir())
    assert not [n for n in names if n.startswith("payload-")]
    folder = tree_folder(tmp_path / "steps", 1)
    assert (folder / "orbax" / "_METADATA").is_file() and (folder / "taskpoint-pytree.json").is_file()
    assert names == sorted(["taskpoint.json", folder.name, f"{folder.name}.files.json"])


def test_a_flipped_byte_in_a_file_is_damage_and_fallback_restores_the_older_step(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(tree(1)), 1)
        m.save(tpjax.PyTree(tree(2)), 2)
        flip_byte(largest_file(tree_folder(directory, 2)))
        with pytest.raises(CheckpointCorruptError, match=r"step 2 .* is damaged: pytree-.* does not match the sha256"):
            m.restore(2)
        with pytest.raises(CheckpointCorruptError, match="step 2"):
            tpjax.load_pytree_sync(m, step=2)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            folder = m.restore(fallback=True)
        assert m.restored_step == 1
        assert_same(tpjax.load_pytree_sync(folder, target=tree(0)), tree(1))
        assert [s.state for s in m.verify().steps] == ["healthy", "damaged"]


def test_a_missing_file_or_a_damaged_list_of_files_is_damage(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(tree(1)), 1)
        m.save(tpjax.PyTree(tree(2)), 2)
        largest_file(tree_folder(directory, 1)).unlink()
        with pytest.raises(CheckpointCorruptError, match=r"step 1 .* its file pytree-.* is missing"):
            m.restore(1)
        listing = tree_folder(directory, 2).with_name(tree_folder(directory, 2).name + ".files.json")
        flip_byte(listing)
        with pytest.raises(CheckpointCorruptError, match=r"step 2 .* list of files"):
            m.restore(2)


def test_archive_pytree_steps_saved_before_still_restore_beside_the_new_ones(tmp_path, monkeypatch):
    directory = tmp_path / "steps"
    with monkeypatch.context() as patch:  # what a taskpoint without the jax.pytree kind saved: a tar archive
        patch.setattr(pytree_kind.PyTreeKind, "accepts", lambda self, payload, parts: False)
        with CheckpointManager(directory) as m:
            m.save(tpjax.PyTree(tree(1)), 1)
    assert [p.name for p in (directory / "ckpt-1").iterdir() if p.name.startswith("payload-")]
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(tree(2)), 2)
        assert [m.describe(s).kind for s in (1, 2)] == ["payload", "jax.pytree"]
        assert_same(tpjax.load_pytree_sync(m, target=tree(0), step=1), tree(1))
        assert_same(tpjax.load_pytree_sync(m, target=tree(0), step=2), tree(2))


def test_retention_and_delete_remove_a_pytree_step_whole(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory, keep=2) as m:
        for step in (1, 2, 3):
            m.save(tpjax.PyTree(tree(step)), step)
        assert m.steps() == [2, 3] and not (directory / "ckpt-1").exists()
        m.delete(3, force=True)
        assert m.steps() == [2] and not (directory / "ckpt-3").exists()


def test_an_overwrite_removes_the_files_of_the_tree_it_replaces(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(tree(1)), 1)
        old = tree_folder(directory, 1)
        m.save(tpjax.PyTree(tree(2)), 1, overwrite=True)
        assert not [p for p in old.rglob("*") if p.is_file()]
        assert not old.with_name(old.name + ".files.json").exists()
        assert_same(tpjax.load_pytree_sync(m, target=tree(0), step=1), tree(2))


def test_gc_removes_the_tree_of_a_save_that_died_once_older_than_the_grace_period(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(tree(1)), 1)
        dead = directory / "ckpt-2" / "pytree-0123456789abcdef0123456789abcdef"  # Orbax wrote it, then a kill
        shutil.copytree(tree_folder(directory, 1), dead)
        assert m.gc() == []  # as fresh as a save in progress
        for path in [dead, *dead.rglob("*")]:
            os.utime(path, (1, 1))
        assert m.gc() == [f"{directory}/ckpt-2/{dead.name}"]
        assert not (directory / "ckpt-2").exists()
        assert m.gc(grace_seconds=0) == [] and m.verify(1).steps[0].state == "healthy"


@pytest.mark.e2e("starts a save process")
def test_a_background_save_is_staged_and_the_save_process_writes_the_kind_a_blocking_save_writes(tmp_path):
    weights = np.arange(6.0)
    with CheckpointManager(tmp_path / "steps", async_save=True) as m:
        m.save(tpjax.PyTree({"w": weights}), 1)
        weights[:] = -1.0  # the arrays were staged when the call returned
        m.wait_until_finished()
        m.save(tpjax.PyTree({"w": weights}), 2, blocking=True)
        assert [m.describe(s).kind for s in (1, 2)] == ["jax.pytree", "jax.pytree"]
        np.testing.assert_array_equal(tpjax.load_pytree_sync(m, step=1)["w"], np.arange(6.0))
        np.testing.assert_array_equal(tpjax.load_pytree_sync(m, step=2)["w"], np.full(6, -1.0))


# -- a load from a manager reads a local step in place ---------------------------------------------------------


def files_below(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_on_local_disk_a_load_reads_the_step_in_place_and_copies_nothing(tmp_path, monkeypatch):
    directory, temp = tmp_path / "steps", tmp_path / "temp"
    temp.mkdir()
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(tree(1)), 1)
        m.save(tpjax.PyTree(tree(2)), 2)
        monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the manager's restores would copy the files
        stored = {p: p.stat().st_size for p in files_below(directory)}
        assert_same(tpjax.load_pytree_sync(m, target=tree(0), step=1), tree(1))
        assert {p: p.stat().st_size for p in files_below(directory)} == stored  # read only (the lease is gone)
        assert_same(tpjax.load_pytree_sync(m), tpjax.load_pytree_sync(m.restore(2)))
        assert m.restored_step == 2
        assert [p.name for p in files_below(temp) if p.name == "taskpoint-pytree.json"] == ["taskpoint-pytree.json"]
        with m.restore_in_place(1) as folder:
            assert folder == tree_folder(directory, 1)
            assert_same(tpjax.load_pytree_sync(folder, target=tree(0)), tree(1))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "missing", "damaged list"])
def test_a_damaged_local_step_fails_the_load_as_its_restore_does_before_orbax_reads_it(tmp_path, damage):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(tree(1)), 1)
        largest = largest_file(tree_folder(directory, 1))
        if damage == "flipped byte":  # Orbax itself would read the wrong value without an error
            flip_byte(largest)
        elif damage == "truncated":  # Orbax would fail with its own error, wrapped in a ValueError with a target
            os.truncate(largest, largest.stat().st_size // 2)
        elif damage == "missing":
            largest.unlink()
        else:
            flip_byte(tree_folder(directory, 1).with_name(tree_folder(directory, 1).name + ".files.json"))
        with pytest.raises(CheckpointCorruptError, match="step 1") as loaded:
            tpjax.load_pytree_sync(m, target=tree(0), step=1)
        with pytest.raises(CheckpointCorruptError) as restored:
            m.restore(1)
        assert str(loaded.value) == str(restored.value)
        assert loaded.value.__cause__ is None  # not an error of Orbax's read


@pytest.mark.parametrize("store", ["memory", "s3"], indirect=True)
def test_on_an_object_store_a_load_reads_a_verified_copy(store):
    with CheckpointManager(store.url("steps"), storage_options=store.storage_options) as m:
        m.save(tpjax.PyTree(tree(1)), 1)
        with m.restore_in_place(1) as folder:
            assert folder.name == "ckpt-1" and folder.exists()  # the manager's restore folder, as restore() returns
            assert sorted(p.name for p in folder.iterdir()) == ["orbax", "taskpoint-pytree.json"]
        assert_same(tpjax.load_pytree_sync(m, target=tree(0), step=1), tree(1))


def test_a_step_read_in_place_is_kept_from_another_managers_retention_and_delete(tmp_path, monkeypatch):
    directory = tmp_path / "steps"
    listed: list[list[int]] = []
    with CheckpointManager(directory) as m, CheckpointManager(directory, keep=1) as other:
        m.save(tpjax.PyTree(tree(1)), 1)
        read_tree = pytree_load.read_tree  # replaced below in the module itself, not in this lazy proxy

        def read_while_the_other_prunes(folder, target, where, **options):
            other.save(tpjax.PyTree(tree(2)), 2)  # its retention keeps one step, and would delete step 1
            with pytest.raises(CheckpointError, match="being restored"):
                other.delete(1, force=True)
            listed.append(other.steps())
            return read_tree(folder, target, where, **options)

        monkeypatch.setattr("taskpoint.jax._load.read_tree", read_while_the_other_prunes)
        assert_same(tpjax.load_pytree_sync(m, target=tree(0), step=1), tree(1))
        assert listed == [[1, 2]]
        other.save(tpjax.PyTree(tree(3)), 3)  # the load is over: retention deletes what it keeps no longer
        assert other.steps() == [3]


def test_files_taken_from_under_orbax_by_another_process_make_the_load_restore_a_copy(tmp_path, monkeypatch):
    directory = tmp_path / "steps"
    folders: list[Path] = []
    with CheckpointManager(directory) as m, CheckpointManager(directory) as other:
        m.save(tpjax.PyTree(tree(1)), 1)
        read_tree = pytree_load.read_tree

        def overwritten_under_the_first_read(folder, target, where, **options):
            folders.append(folder)
            if len(folders) == 1:  # another process's overwrite: a new tree committed, then the old one removed
                other.save(tpjax.PyTree(tree(2)), 1, overwrite=True)
                shutil.rmtree(folder)
                folder.with_name(f"{folder.name}.files.json").unlink()
            return read_tree(folder, target, where, **options)

        monkeypatch.setattr("taskpoint.jax._load.read_tree", overwritten_under_the_first_read)
        assert_same(tpjax.load_pytree_sync(m, target=tree(0), step=1), tree(2))
        assert folders[0].name.startswith("pytree-") and folders[1].name == "ckpt-1"



# -- large files listed by pieces ---------------------------------------------------------------------------------

def large_tree(seed: int) -> dict[str, object]:
    """A tree whose largest file Orbax writes holds more than two pieces (40 MiB of float32)."""
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=10 << 20).astype(np.float32)), "step": seed}


def listing_of(directory: Path, step: int) -> dict[str, object]:
    folder = tree_folder(directory, step)
    return json.loads(folder.with_name(folder.name + ".files.json").read_bytes())


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_a_file_larger_than_a_piece_is_listed_by_the_blake3_of_each_piece(store):
    with CheckpointManager(store.url("steps"), storage_options=store.storage_options) as m:
        m.save(tpjax.PyTree(large_tree(1)), 1)
        assert_same(tpjax.load_pytree_sync(m, target=large_tree(0), step=1), large_tree(1))
        assert m.verify(1).steps[0].state == "healthy"
        restored = m.restore(1)
        fs, root = fsspec.core.url_to_fs(store.url("steps/ckpt-1"), **store.storage_options)
        (listing,) = [p for p in fs.ls(root, detail=False) if p.endswith(".files.json")]
        assert json.loads(fs.cat_file(listing))["version"] == 3
        files = fileset.FileSetManifest.from_bytes(fs.cat_file(listing), listing).files
        pieced = {rel: entry for rel, entry in files.items() if entry.pieces}
        ((rel, entry),) = pieced.items()  # the one large file of Orbax's; the small ones keep one sha256 each
        assert entry.size > 2 * fileset.PIECE_SIZE and len(entry.pieces) == -(-entry.size // fileset.PIECE_SIZE)
        data = (restored / rel).read_bytes()
        assert entry.piece_hash == "blake3"
        assert list(entry.pieces) == [blake3.blake3(data[i:i + fileset.PIECE_SIZE]).hexdigest()
                                      for i in range(0, len(data), fileset.PIECE_SIZE)]
        assert entry.sha256 == fileset.pieces_digest(entry.pieces)
        assert all(not e.pieces and e.sha256 == hashlib.sha256((restored / r).read_bytes()).hexdigest()
                   for r, e in files.items() if r != rel)


@pytest.mark.parametrize("how", ["in place", "copy", "verify"])
def test_a_flipped_byte_in_a_piece_is_damage_that_names_the_piece(tmp_path, how):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(large_tree(1)), 1)
        largest = largest_file(tree_folder(directory, 1))
        flip_byte_at(largest, fileset.PIECE_SIZE + 7)
        expected = r"step 1 .* is damaged: piece 1 of pytree-.* \(bytes 16777216-\d+\)"
        if how == "in place":
            with pytest.raises(CheckpointCorruptError, match=expected):
                tpjax.load_pytree_sync(m, target=large_tree(0), step=1)
        elif how == "copy":
            with pytest.raises(CheckpointCorruptError, match=expected):
                m.restore(1)
        else:
            (checked,) = m.verify().steps
            assert checked.state == "damaged" and "piece 1" in checked.detail


def test_a_large_file_listed_whole_by_an_older_taskpoint_still_restores_and_verifies(tmp_path, monkeypatch):
    directory = tmp_path / "steps"
    with monkeypatch.context() as patch:  # what a taskpoint before pieces wrote: one sha256 for every file
        patch.setattr("taskpoint.manager.kinds.files.PIECE_SIZE", 1 << 40)
        with CheckpointManager(directory) as m:
            m.save(tpjax.PyTree(large_tree(1)), 1)
    listing = listing_of(directory, 1)
    assert listing["version"] == 1 and not [e for e in listing["files"].values() if "pieces" in e]
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(large_tree(2)), 2)
        assert listing_of(directory, 2)["version"] == 3
        assert_same(tpjax.load_pytree_sync(m, target=large_tree(0), step=1), large_tree(1))
        assert_same(tpjax.load_pytree_sync(m.restore(1), target=large_tree(0)), large_tree(1))
        assert [s.state for s in m.verify().steps] == ["healthy", "healthy"]
        flip_byte(largest_file(tree_folder(directory, 1)))
        with pytest.raises(CheckpointCorruptError, match=r"step 1 .* is damaged: .* does not match the sha256 recorded "
                                                         r"when it was saved \(.* it was saved with \d+ bytes"):
            tpjax.load_pytree_sync(m, target=large_tree(0), step=1)


def test_a_listing_whose_pieces_disagree_with_its_digest_or_size_is_damage():
    good = fileset.FileEntry.of_pieces(fileset.PIECE_SIZE + 1, ["a" * 64, "b" * 64], "blake3")
    manifest = fileset.FileSetManifest(kind="jax.orbax", save_id="x", created=1.0, files={"big": good})
    assert fileset.FileSetManifest.from_bytes(manifest.to_bytes(), "u").files == {"big": good}
    for bad in (fileset.FileEntry(good.size, good.sha256, ("a" * 64,)),  # a piece short for its size
                fileset.FileEntry(good.size, "c" * 64, good.pieces),  # pieces that are not its sha256's
                fileset.FileEntry(3 * fileset.PIECE_SIZE, good.sha256, good.pieces)):
        data = fileset.FileSetManifest(kind="jax.orbax", save_id="x", created=1.0, files={"big": bad}).to_bytes()
        with pytest.raises(CheckpointCorruptError, match="unreadable"):
            fileset.FileSetManifest.from_bytes(data, "u")
    unknown = json.loads(manifest.to_bytes())
    unknown["files"]["big"]["piece_hash"] = "md5"
    with pytest.raises(CheckpointCorruptError, match=r"unreadable .*pieces hashed by 'md5'"):
        fileset.FileSetManifest.from_bytes(sealed(unknown), "u")
    whole = b"x" * 5 + b"y" * (2 * fileset.PIECE_SIZE) + b"z"
    for name, make in (("blake3", blake3.blake3), ("sha256", hashlib.sha256)):
        hasher = fileset.PieceHasher(name)
        for part in (b"x" * 5, b"y" * (2 * fileset.PIECE_SIZE), b"z"):
            hasher.update(part)
        assert hasher.entry() == fileset.FileEntry.of_pieces(len(whole), [
            make(whole[i:i + fileset.PIECE_SIZE]).hexdigest() for i in range(0, len(whole), fileset.PIECE_SIZE)], name)
    whole_hasher = fileset.PieceHasher(None)
    whole_hasher.update(whole)
    assert whole_hasher.entry() == fileset.FileEntry(len(whole), hashlib.sha256(whole).hexdigest())


def test_a_step_whose_pieces_an_older_taskpoint_hashed_by_sha256_restores_verifies_and_catches_damage(
        tmp_path, monkeypatch):
    directory = tmp_path / "steps"
    # Pieces by sha256, as taskpoint wrote them before BLAKE3. It wrote them as version 2, which names no piece
    # hash; no writer writes that form now (a set of sha256 pieces is version 3, naming it), and
    # test_legacy_readers reads one built by hand.
    with monkeypatch.context() as patch:
        patch.setattr("taskpoint.manager.kinds.files.PIECE_HASH", "sha256")
        with CheckpointManager(directory) as m:
            m.save(tpjax.PyTree(large_tree(1)), 1)
    listing = listing_of(directory, 1)
    pieced = [e for e in listing["files"].values() if "pieces" in e]
    assert listing["version"] == 3 and len(pieced) == 1 and pieced[0]["piece_hash"] == "sha256"
    data = largest_file(tree_folder(directory, 1)).read_bytes()
    assert pieced[0]["pieces"] == [hashlib.sha256(data[i:i + fileset.PIECE_SIZE]).hexdigest()
                                   for i in range(0, len(data), fileset.PIECE_SIZE)]
    with CheckpointManager(directory) as m:
        assert_same(tpjax.load_pytree_sync(m, target=large_tree(0), step=1), large_tree(1))
        assert_same(tpjax.load_pytree_sync(m.restore(1), target=large_tree(0)), large_tree(1))
        assert m.verify(1).steps[0].state == "healthy"
        flip_byte_at(largest_file(tree_folder(directory, 1)), fileset.PIECE_SIZE + 7)
        with pytest.raises(CheckpointCorruptError,
                           match=r"piece 1 of .* \(bytes 16777216-\d+\) does not match the sha256"):
            tpjax.load_pytree_sync(m, target=large_tree(0), step=1)
        with pytest.raises(CheckpointCorruptError, match=r"piece 1 of .* the sha256 recorded when it was saved"):
            m.restore(1)


def test_a_taskpoint_that_reads_only_sha256_pieces_asks_to_be_upgraded_for_blake3_ones(tmp_path, monkeypatch):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpjax.PyTree(large_tree(1)), 1)
        monkeypatch.setattr(fileset, "FILESET_VERSION", 2)  # the newest version the previous release read
        with pytest.raises(CheckpointCorruptError, match="format version 3, newer than this taskpoint understands "
                                                         r"\(2\); upgrade taskpoint"):
            tpjax.load_pytree_sync(m, target=large_tree(0), step=1)


def test_the_orbax_handler_reads_a_local_step_in_place_and_names_the_step_when_it_is_damaged(tmp_path, monkeypatch):
    directory = tmp_path / "ckpts"
    with tpjax.OrbaxCheckpointHandler() as handler:
        handler.save(directory, tree(1), step=1)
        handler.save(directory, tree(2), step=2)
        with monkeypatch.context() as patch:  # a copy of the step's files would go through the kind's restore
            patch.setattr(pytree_kind.PyTreeKind, "restore", lambda *args: pytest.fail("the step was copied"))
            assert_same(handler.restore(directory, tree(0), step=1), tree(1))
            assert_same(handler.checkpointer.restore(directory / "ckpt-1", tree(0)), tree(1))
        flip_byte(largest_file(tree_folder(directory, 2)))
        with pytest.raises(CheckpointCorruptError, match=r"step 2 in .*ckpts is damaged") as raised:
            handler.restore(directory, tree(0), step=2)
        assert raised.value.__cause__ is None  # found by the check before Orbax read anything


def test_restore_in_place_counts_the_bytes_it_checks_in_progress(tmp_path):
    from test_progress import Recorder

    with CheckpointManager(tmp_path / "steps") as m:
        m.save(tpjax.PyTree(tree(1)), 1)
        counted = Recorder()
        with m.restore_in_place(1, progress=counted) as folder:
            assert folder == tree_folder(tmp_path / "steps", 1)
        counted.assert_exact(sum(p.stat().st_size for p in files_below(folder)))
        with pytest.raises(TypeError, match="progress"), m.restore_in_place(1, progress="yes"):
            pass
