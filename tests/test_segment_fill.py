"""The trainer's copy into a staging segment (issue 43): ``Segment.fill`` writes each piece at its offset by
``pwrite``, never mapping the segment in the trainer (a mapping's page faults cost more than the copy); the torch
and JAX plans copy a state through it, and the save process's views of the segment read back exactly that state."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from taskpoint.manager import staging
from taskpoint.manager.staging import Segment
from taskpoint.payloads import BytesPayload


def _mapped_here(path: Path) -> bool:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return any(path.name in line for line in maps)


def test_fill_writes_each_piece_at_its_offset_without_mapping_the_segment(tmp_path):
    segment = Segment.create(4096 + 64, folder=tmp_path)
    floats = np.arange(6, dtype=np.float32).reshape(2, 3)
    segment.fill([(0, b"abc"), (64, memoryview(b"xyz")), (128, floats), (4096, np.full(64, 7, np.uint8))])
    assert not _mapped_here(segment.path)
    data = segment.path.read_bytes()
    assert len(data) == 4096 + 64
    assert data[:3] == b"abc" and data[64:67] == b"xyz" and data[4096:] == b"\7" * 64
    assert np.frombuffer(data, np.float32, count=6, offset=128).tolist() == floats.ravel().tolist()
    assert data[3:64] == bytes(61)  # what no piece covers stays as reserved: zero
    assert bytes(segment.buffer[64:67]) == b"xyz"  # mapped on first use, as the save process reads it
    assert _mapped_here(segment.path)
    segment.free()
    assert not segment.path.exists() and not _mapped_here(segment.path)


def test_a_piece_larger_than_a_part_is_written_in_parts_each_at_its_place(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "FILL_PART", 1000)  # parts on several threads, in no set order
    data = os.urandom(10_500)
    segment = Segment.create(64 + len(data), folder=tmp_path)
    segment.fill([(64, data), (0, b"head")])
    assert segment.path.read_bytes() == b"head" + bytes(60) + data


def test_resize_keeps_what_was_written_and_a_removed_segment_is_not_reused(tmp_path):
    segment = Segment.create(4096, folder=tmp_path)
    segment.fill([(0, b"kept")])
    segment.resize(4096)
    segment.resize(3 * 4096)
    assert segment.size == os.stat(segment.path).st_size == 3 * 4096
    segment.resize(2)
    assert segment.path.read_bytes() == b"ke"
    os.unlink(segment.path)  # removed by hand between two saves: the next one makes a new segment
    with pytest.raises(FileNotFoundError):
        segment.resize(2)


def test_bytes_are_staged_as_they_are(tmp_path):
    original = os.urandom(10_000)
    data = bytearray(original)
    segment = Segment.create(len(data), folder=tmp_path)
    staged = BytesPayload(data).stage(segment)
    data[:] = bytes(len(data))  # the caller's buffer changes at once
    assert staged.size() == 10_000 and segment.path.read_bytes() == original
    assert not _mapped_here(segment.path)
    segment.free()


def test_a_state_dict_copied_into_a_segment_reads_back_the_same_state(tmp_path):
    torch = pytest.importorskip("torch")
    from taskpoint.torch._staged import Plan, _rebuild, _views

    weight = torch.randn(4, 6)
    state = {"weight": weight, "tied": weight, "column": weight[:, 1], "transposed": weight.t(),
             "half": torch.arange(5, dtype=torch.bfloat16), "empty": torch.zeros(0), "step": 3,
             "nested": [torch.ones(3, dtype=torch.int64), {"flag": torch.tensor(True)}]}
    plan = Plan(state)
    segment = Segment.create(plan.size, folder=tmp_path)
    staged = plan.copy_into(segment)
    assert not _mapped_here(segment.path)
    weight.mul_(2)  # the trainer changes its tensors once save() returned
    copy = Segment(segment.path, segment.size)  # the save process's own mapping
    rebuilt = _rebuild(staged._skeleton, _views(copy, staged._spans))
    assert rebuilt["step"] == 3
    assert rebuilt["tied"].untyped_storage().data_ptr() == rebuilt["weight"].untyped_storage().data_ptr()
    expected = weight / 2
    for key, want in {"weight": expected, "tied": expected, "column": expected[:, 1], "transposed": expected.t(),
                      "half": state["half"], "empty": state["empty"]}.items():
        assert rebuilt[key].dtype == want.dtype and rebuilt[key].stride() == want.stride()
        assert torch.equal(rebuilt[key], want), key
    assert torch.equal(rebuilt["nested"][0], torch.ones(3, dtype=torch.int64))
    assert rebuilt["nested"][1]["flag"].item() is True
    del rebuilt
    copy.unmap()
    segment.free()


def test_a_pytree_copied_into_a_segment_reads_back_the_same_arrays(tmp_path):
    jax = pytest.importorskip("jax")
    from taskpoint.jax._pytree import encode
    from taskpoint.jax._staged import TreePlan, rebuilt

    grid = np.arange(12, dtype=np.float64).reshape(3, 4)
    tree = {"w": jax.numpy.arange(10, dtype=jax.numpy.bfloat16), "columns": grid.T, "every_other": grid[:, ::2],
            "scalar": np.float32(1.5), "zero_d": np.array(7, dtype=np.int16), "empty": np.zeros((0, 3))}
    expected = {key: np.array(value) for key, value in tree.items()}
    plan = TreePlan(encode(tree))
    assert plan.size is not None
    segment = Segment.create(plan.size, folder=tmp_path)
    staged = plan.copy_into(segment)
    assert not _mapped_here(segment.path)
    grid[:] = -1  # the caller's numpy arrays change at once
    copy = Segment(segment.path, segment.size)
    arrays = rebuilt(copy, staged.skeleton).arrays
    assert len(arrays) == len(tree) - 1  # all but the empty array, which has no bytes to stage
    for got in arrays.values():
        want = next(value for value in expected.values()
                    if value.dtype == got.dtype and value.shape == got.shape)
        np.testing.assert_array_equal(np.asarray(got), want)
    del arrays
    copy.unmap()
    segment.free()


def test_a_segment_larger_than_its_folder_can_hold_is_refused_before_a_byte_is_copied(tmp_path):
    stat = os.statvfs(tmp_path)
    with pytest.raises(OSError) as info:
        Segment.create(stat.f_bavail * stat.f_frsize + (1 << 30), folder=tmp_path)
    assert info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_fill_allocates_the_pages_of_a_fresh_segment_as_it_writes_them(tmp_path):
    segment = Segment.create(8 * 4096, folder=tmp_path)
    assert os.stat(segment.path).st_blocks == 0  # no page taken before the copy
    data = os.urandom(8 * 4096)
    segment.fill([(0, data)])
    assert os.stat(segment.path).st_blocks * 512 >= len(data) and segment.path.read_bytes() == data
    segment.reserve()  # for a copy through a mapping: every page there already, nothing changes
    assert segment.path.read_bytes() == data
    segment.free()
