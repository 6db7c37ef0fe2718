"""Torch state dicts in CheckpointManager steps (``taskpoint.torch.StateDict``, the ``torch.state_dict`` step
kind), with real torch on the CPU: what the step holds, what a load verifies, and how retention, delete, gc,
verify and describe treat it; on local disk and the S3 server."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import anyio
import blake3
import pytest

from helpers import LazyModule, requires
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointManager

pytestmark = requires("torch")

torch = LazyModule("torch")
tpt = LazyModule("taskpoint.torch")


def model_state(seed: int) -> dict[str, object]:
    """A model's and its optimizer's state dicts after one Adam step: tensors of several dtypes, and the
    optimizer's nested state (int keys, param groups with floats, bools and tuples)."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16, generator=generator)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": seed,
            "extra": {"half": torch.randn(5, generator=generator).half(),
                      "bf16": torch.randn(3, 3, generator=generator).bfloat16(),
                      "ints": torch.arange(7, dtype=torch.int64) * seed, "mask": torch.tensor([True, False]),
                      "u8": torch.arange(10, dtype=torch.uint8), "name": f"run-{seed}"}}


def assert_same(actual: object, expected: object, where: str = "") -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for number, (a, b) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, b, f"{where}[{number}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, where


def state_file(directory: Path, step: int) -> Path:
    (found,) = (directory / f"ckpt-{step}").glob("state-*.pt")
    return found


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_a_state_dict_step_round_trips_every_dtype_and_the_nested_optimizer_state(store):
    with CheckpointManager(store.url("steps"), storage_options=store.storage_options) as m:
        m.save(tpt.StateDict(model_state(1)), 1, metadata={"epoch": 1})
        described = m.describe(1)
        assert (described.kind, described.codec, described.payload_kind) == (
            "torch.state_dict", "torch.save", "torch.state_dict")
        assert described.payload.startswith("state-") and described.details["pieces"] == 1
        assert_same(tpt.load_state_dict_sync(m), model_state(1))
        folder = m.restore(1)
        assert sorted(p.name for p in folder.iterdir()) == [tpt.STATE_FILE]
        assert_same(torch.load(folder / tpt.STATE_FILE, weights_only=True), model_state(1))
        with m.open(1, tpt.STATE_FILE) as f:
            assert_same(torch.load(f, weights_only=True), model_state(1))
        assert m.verify(1).steps[0].state == "healthy"
        assert [s.state for s in m.inventory()] == ["committed"]


def test_on_local_disk_the_step_is_the_torch_save_file_itself(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpt.StateDict(model_state(2)), 2)
        names = sorted(p.name for p in (directory / "ckpt-2").iterdir())
        assert names == sorted(["taskpoint.json", state_file(directory, 2).name])
        assert_same(torch.load(state_file(directory, 2), weights_only=True), model_state(2))
        assert m.describe(2).size == state_file(directory, 2).stat().st_size


def manifest_of(directory: Path, step: int) -> dict[str, object]:
    return json.loads((directory / f"ckpt-{step}" / "taskpoint.json").read_bytes())


def test_the_pieces_are_the_blake3_of_each_piece_and_the_manifest_is_version_5(tmp_path, monkeypatch):
    monkeypatch.setattr("taskpoint.torch._state_file.PIECE_SIZE", 4096)
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpt.StateDict({"big": torch.arange(5000, dtype=torch.float32)}), 1)
        manifest, data = manifest_of(directory, 1), state_file(directory, 1).read_bytes()
        assert manifest["version"] == 5 and manifest["content"]["piece_hash"] == "blake3"
        assert manifest["content"]["pieces"] == [blake3.blake3(data[at:at + 4096]).hexdigest()
                                                 for at in range(0, len(data), 4096)]
        assert m.describe(1).details["piece_hash"] == "blake3"
        assert "blake3 match" in m.verify(1).steps[0].detail
        flip_byte(state_file(directory, 1), 4096 + 3)
        with pytest.raises(CheckpointCorruptError, match=r"piece 1 of state-.* does not match the blake3"):
            tpt.load_state_dict_sync(m, 1)


def test_a_step_whose_pieces_an_older_taskpoint_hashed_by_sha256_loads_and_catches_damage(tmp_path, monkeypatch):
    directory = tmp_path / "steps"
    with monkeypatch.context() as patch:  # what taskpoint wrote before BLAKE3: version 4, sha256 pieces
        patch.setattr("taskpoint.torch._state_file.PIECE_HASH", "sha256")
        patch.setattr("taskpoint.torch._state_file.PIECE_SIZE", 4096)
        with CheckpointManager(directory) as m:
            m.save(tpt.StateDict({"big": torch.arange(5000, dtype=torch.float32)}), 1)
    manifest, data = manifest_of(directory, 1), state_file(directory, 1).read_bytes()
    assert manifest["version"] == 4 and "piece_hash" not in manifest["content"]
    assert manifest["content"]["pieces"] == [hashlib.sha256(data[at:at + 4096]).hexdigest()
                                             for at in range(0, len(data), 4096)]
    with CheckpointManager(directory) as m:
        assert_same(tpt.load_state_dict_sync(m, 1), {"big": torch.arange(5000, dtype=torch.float32)})
        assert "sha256 match" in m.verify(1).steps[0].detail
        flip_byte(state_file(directory, 1), 4096 * 2 + 3)
        with pytest.raises(CheckpointCorruptError, match=r"piece 2 of state-.* does not match the sha256"):
            tpt.load_state_dict_sync(m, 1)


def test_a_taskpoint_that_reads_version_4_asks_to_be_upgraded_for_blake3_pieces(tmp_path, monkeypatch):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpt.StateDict(model_state(1)), 1)
        monkeypatch.setattr("taskpoint.format.records.FORMAT_VERSION", 4)  # the previous release's newest
        with pytest.raises(CheckpointCorruptError, match=r"format version 5, newer than this taskpoint understands "
                                                         r"\(4\); upgrade taskpoint"):
            tpt.load_state_dict_sync(m, 1)


def test_a_file_of_several_pieces_is_read_back_through_seeks_and_reads(tmp_path, monkeypatch):
    monkeypatch.setattr("taskpoint.torch._state_file.PIECE_SIZE", 4096)
    state = {"big": torch.arange(20_000, dtype=torch.float32), "small": torch.ones(3)}
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpt.StateDict(state), 1)
        data = state_file(directory, 1).read_bytes()
        assert m.describe(1).details["pieces"] == -(-len(data) // 4096) > 10
        with m.open(1, tpt.STATE_FILE) as f:
            for start, length in ((len(data) - 100, 500), (0, 10), (4000, 9000), (12_345, 1)):
                f.seek(start)
                assert f.read(length) == data[start:start + length]
            f.seek(-5, os.SEEK_END)
            assert f.read() == data[-5:]
        assert_same(tpt.load_state_dict_sync(m, 1), state)


def test_a_flipped_byte_is_damage_and_fallback_loads_the_previous_step(tmp_path, monkeypatch):
    monkeypatch.setattr("taskpoint.torch._state_file.PIECE_SIZE", 4096)
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpt.StateDict(model_state(1)), 1)
        m.save(tpt.StateDict(model_state(2)), 2)
        damaged = state_file(directory, 2)
        flip_byte(damaged, damaged.stat().st_size // 2)
        with pytest.raises(CheckpointCorruptError, match=r"step 2 .* is damaged: piece \d+ of state-"):
            tpt.load_state_dict_sync(m, 2)
        with pytest.raises(CheckpointCorruptError, match="step 2"):
            tpt.load_state_dict_sync(m)
        with pytest.raises(CheckpointCorruptError, match="step 2"):
            m.restore(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_same(tpt.load_state_dict_sync(m, fallback=True), model_state(1))
            folder = m.restore(fallback=True)
        assert any("step 2" in str(w.message) for w in caught)
        assert m.restored_step == 1
        assert_same(torch.load(folder / tpt.STATE_FILE, weights_only=True), model_state(1))
        assert [s.state for s in m.verify().steps] == ["healthy", "damaged"]


def test_a_missing_or_truncated_file_is_damage(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpt.StateDict(model_state(1)), 1)
        m.save(tpt.StateDict(model_state(2)), 2)
        state_file(directory, 1).unlink()
        with pytest.raises(CheckpointCorruptError, match=r"step 1 .* its file state-.* is missing"):
            m.restore(1)
        path = state_file(directory, 2)
        path.write_bytes(path.read_bytes()[:-10])
        with pytest.raises(CheckpointCorruptError, match=r"step 2 .* is damaged"):
            tpt.load_state_dict_sync(m, 2)
        assert [s.state for s in m.verify().steps] == ["damaged", "damaged"]


@pytest.mark.parametrize("bad", [[1, 2], "weights", {1: torch.ones(1)}, {"w": object()},
                                 {"nested": {"fn": len}}])
def test_what_is_not_a_state_dict_is_a_type_error_and_saves_nothing(tmp_path, bad):
    with CheckpointManager(tmp_path / "steps") as m:
        with pytest.raises(TypeError, match="StateDict"):
            m.save(tpt.StateDict(bad), 1)
        assert m.steps() == [] and not (tmp_path / "steps" / "ckpt-1").exists()


def test_a_path_the_step_lacks_is_a_key_error(tmp_path):
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(tpt.StateDict(model_state(1)), 1)
        with pytest.raises(KeyError, match=r"model\.pt"):
            m.open(1, "model.pt")
        with pytest.raises(KeyError, match=r"model\.pt"):
            m.restore(1, paths=["model.pt"])
        folder = m.restore(1, paths=[tpt.STATE_FILE])
        assert_same(torch.load(folder / tpt.STATE_FILE, weights_only=True), model_state(1))


def test_retention_delete_and_overwrite_remove_the_file(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory, keep=2) as m:
        for step in (1, 2, 3):
            m.save(tpt.StateDict(model_state(step)), step)
        assert m.steps() == [2, 3] and not (directory / "ckpt-1").exists()
        old = state_file(directory, 3)
        m.save(tpt.StateDict(model_state(4)), 3, overwrite=True)
        assert not old.exists() and state_file(directory, 3) != old
        assert_same(tpt.load_state_dict_sync(m, 3), model_state(4))
        m.delete(3, force=True)
        assert m.steps() == [2] and not (directory / "ckpt-3").exists()
        assert tpt.load_state_dict_sync(m)["step"] == 2


def test_gc_removes_the_file_of_a_save_that_died_once_older_than_the_grace_period(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpt.StateDict(model_state(1)), 1)
        dead = directory / "ckpt-2" / ".state-0123456789abcdef0123456789abcdef.pt.0123456789ab.tmp"
        dead.parent.mkdir()
        dead.write_bytes(state_file(directory, 1).read_bytes())  # torch.save was writing it, then a kill
        assert m.gc() == []  # as fresh as a save in progress
        os.utime(dead, (1, 1))
        assert m.gc() == [f"{directory}/ckpt-2/{dead.name}"]
        assert not (directory / "ckpt-2").exists()
        assert m.gc(grace_seconds=0) == [] and m.verify(1).steps[0].state == "healthy"


@pytest.mark.e2e("starts a save process")
def test_a_background_save_snapshots_the_tensors_and_loads_back_the_same(tmp_path):
    weights = torch.arange(6.0)
    with CheckpointManager(tmp_path / "steps", async_save=True) as m:
        m.save(tpt.StateDict({"w": weights}), 1)
        weights[:] = -1.0  # the snapshot was taken when the call returned
        m.wait_until_finished()
        m.save(tpt.StateDict({"w": weights}), 2, blocking=True)
        assert [m.describe(s).kind for s in (1, 2)] == ["torch.state_dict", "torch.state_dict"]  # staged: issue 43
        assert torch.equal(tpt.load_state_dict_sync(m, 1)["w"], torch.arange(6.0))
        assert torch.equal(tpt.load_state_dict_sync(m, 2)["w"], torch.full((6,), -1.0))


def test_a_single_checkpoint_stores_the_torch_save_bytes(tmp_path):
    Checkpoint(tmp_path / "a").save_sync(tpt.StateDict(model_state(3)))
    with Checkpoint(tmp_path / "b", tmp_path / "a") as cp:
        assert_same(torch.load(cp.load_sync(), weights_only=True), model_state(3))


def test_no_step_loads_as_none(tmp_path):
    with CheckpointManager(tmp_path / "steps") as m:
        assert tpt.load_state_dict_sync(m) is None


def mapped_file(tensor: object) -> str | None:
    """The file whose mapping holds the tensor's memory (from /proc/self/maps), None when none does."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_mmap_loads_the_same_values_sharing_memory_with_the_step_file_which_writes_leave_alone(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpt.StateDict(model_state(1)), 1)
        before = state_file(directory, 1).read_bytes()
        loaded = tpt.load_state_dict_sync(m, mmap=True)
        assert_same(loaded, model_state(1))
        weight = loaded["model"]["0.weight"]
        assert mapped_file(weight) == str(state_file(directory, 1))
        assert mapped_file(tpt.load_state_dict_sync(m)["model"]["0.weight"]) != str(state_file(directory, 1))
        weight.fill_(7.0)  # a private mapping: the step's file stays as it was
        assert state_file(directory, 1).read_bytes() == before
        assert_same(tpt.load_state_dict_sync(m, 1, mmap=True), model_state(1))


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_mmap_from_an_object_store_maps_a_verified_local_copy(store):
    with CheckpointManager(store.url("steps"), storage_options=store.storage_options) as m:
        m.save(tpt.StateDict(model_state(2)), 2)
        assert_same(tpt.load_state_dict_sync(m, mmap=True), model_state(2))


def test_mmap_of_a_step_saved_another_way_maps_its_restored_file(tmp_path):
    # a background save from a thread (no save process) stores the torch.save bytes as a payload
    with CheckpointManager(tmp_path / "steps", async_save=True, background_process=False) as m:
        m.save(tpt.StateDict(model_state(3)), 3)
        m.wait_until_finished()
        assert m.describe(3).kind == "payload"
        assert_same(tpt.load_state_dict_sync(m, 3, mmap=True), model_state(3))


def test_mmap_refuses_a_damaged_file_before_any_tensor_and_fallback_maps_the_previous_step(tmp_path):
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as m:
        m.save(tpt.StateDict(model_state(1)), 1)
        m.save(tpt.StateDict(model_state(2)), 2)
        damaged = state_file(directory, 2)
        flip_byte(damaged, damaged.stat().st_size - 200)  # inside the zip's directory, which torch.load checks
        with pytest.raises(CheckpointCorruptError, match=r"step 2 .* is damaged: piece 0 of state-"):
            tpt.load_state_dict_sync(m, 2, mmap=True)
        flip_byte(damaged, damaged.stat().st_size - 200)
        flip_byte(damaged, damaged.stat().st_size // 2)  # inside a tensor, which torch.load(mmap=True) never reads
        with pytest.raises(CheckpointCorruptError, match=r"step 2 .* is damaged"):
            tpt.load_state_dict_sync(m, 2, mmap=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_same(tpt.load_state_dict_sync(m, fallback=True, mmap=True), model_state(1))
        assert any("step 2" in str(w.message) for w in caught)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_mmap_that_is_not_a_bool_is_a_type_error(tmp_path, bad):
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(tpt.StateDict(model_state(1)), 1)
        with pytest.raises(TypeError, match="mmap is True or False"):
            tpt.load_state_dict_sync(m, mmap=bad)
        with pytest.raises(TypeError, match="mmap is True or False"):
            anyio.run(lambda: tpt.load_state_dict(m, mmap=bad))


def _flip(at: int):  # the damages below: the file's bytes in, the damaged bytes out
    def damage(data: bytes) -> bytes:
        at_ = at if at >= 0 else len(data) + at
        return data[:at_] + bytes([data[at_] ^ 0xFF]) + data[at_ + 1:]
    return damage


#: Every way a state-dict step's file can differ from what was committed: a flipped byte in its first, a middle
#: and its last piece, cut short, and one byte appended (which a PyTree step's check refuses too).
STATE_DAMAGE = {
    "flipped-in-the-first-piece": _flip(100),
    "flipped-in-a-middle-piece": _flip(5 * 65536 + 123),
    "flipped-in-the-last-piece": _flip(-300),
    "truncated": lambda data: data[:-10],
    "one-byte-appended": lambda data: data + b"\0",
}


def large_state(seed: int) -> dict[str, object]:
    """About 1 MiB in tensors: 16 pieces of 64 KiB, so that ``torch.load`` reads across many pieces."""
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(16384, generator=generator) for i in range(16)}


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
@pytest.mark.parametrize("damage", list(STATE_DAMAGE))
def test_every_damage_of_a_state_dict_step_is_corrupt_on_every_read_and_fallback_loads_the_older_step(
        store, monkeypatch, damage):
    """Whatever differs in the step's file, every read path raises CheckpointCorruptError (never what torch.load
    makes of a failed read, such as "ValueError: read of closed file"), fallback=True loads the older step, and
    verify() reports the step damaged."""
    monkeypatch.setattr("taskpoint.torch._state_file.PIECE_SIZE", 65536)
    directory = store.url("steps")
    with CheckpointManager(directory, storage_options=store.storage_options) as m:
        m.save(tpt.StateDict(large_state(1)), 1)
        m.save(tpt.StateDict(large_state(2)), 2)
        fs = store.fs()
        (path,) = fs.glob(f"{directory}/ckpt-2/state-*.pt")
        fs.pipe_file(path, STATE_DAMAGE[damage](fs.cat_file(path)))
        for mmap in (False, True):
            with pytest.raises(CheckpointCorruptError, match=r"step 2 .* is damaged"):
                tpt.load_state_dict_sync(m, 2, mmap=mmap)
        with pytest.raises(CheckpointCorruptError, match=r"step 2 .* is damaged"):
            m.restore(2)
        with pytest.raises(CheckpointCorruptError, match=r"step 2 .* is damaged"), m.open(2, tpt.STATE_FILE) as f:
            f.read()
        for step in (2, None):
            for mmap in (False, True):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    assert_same(tpt.load_state_dict_sync(m, step, fallback=True, mmap=mmap), large_state(1))
                assert any("step 2" in str(w.message) for w in caught)
        assert [s.state for s in m.verify().steps] == ["healthy", "damaged"]
