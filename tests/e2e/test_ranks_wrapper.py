"""Ranks as a wrapper around any step kind (issue 41): under the real ``torchrun`` (3 ranks, gloo), each rank stores
its part of a step in the kind one rank would choose for its data (a state dict as ``torch.state_dict``, bytes as
one payload object), rank 0 commits one ``ranks`` manifest naming each rank's kind, content and record, and each
rank reads its own part back through its kind (tests/_ranks_wrapper_worker.py). The step is then read, verified,
damaged and deleted from this process as any step is, with what a manager of another number of ranks is told."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from helpers import TORCHRUN, run_torchrun
from taskpoint import CheckpointCorruptError, CheckpointError, CheckpointManager

WORKER = Path(__file__).parents[1] / "_ranks_wrapper_worker.py"
WORLD = 3
#: The bound of the launch: three ranks import torch on two busy cores and save two steps.
WITHIN = 300.0

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs the torch extra"),
    pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun beside python"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of steps 1 and 2, saved by the 3-rank job, whose every rank read its parts back."""
    directory = tmp_path_factory.mktemp("ranks") / "ckpts"
    status, out, err = run_torchrun(WORKER, WORLD, json.dumps({"directory": str(directory)}), WITHIN)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert status == 0, err[-3000:]
    assert sorted(e["rank"] for e in events if e.get("event") == "done") == list(range(WORLD)), (events, err[-3000:])
    reads = sorted((e["rank"], e["steps"], e["read"]) for e in events if "read" in e)
    assert reads == [(rank, [1, 2, 3], [True] * 3) for rank in range(WORLD)], reads
    return directory


def manifest(directory: Path, step: int) -> dict[str, Any]:
    return json.loads((directory / f"ckpt-{step}" / "taskpoint.json").read_bytes())


def test_each_rank_stores_its_part_in_the_kind_one_rank_would_choose(saved: Path) -> None:
    one, two = manifest(saved, 1), manifest(saved, 2)
    # step 1 has a payload part, recorded by BLAKE3 pieces: version 7 (6 before 758143b, by one BLAKE3); step 2's
    # parts are all state dicts: version 4
    assert (one["version"], two["version"], one["step_kind"], two["step_kind"]) == (7, 4, "ranks", "ranks")
    assert [s["step_kind"] for s in one["content"]["shards"]] == ["torch.state_dict", "payload", "torch.state_dict"]
    assert [s["step_kind"] for s in two["content"]["shards"]] == ["torch.state_dict"] * WORLD
    files = [s["content"]["file"] for s in two["content"]["shards"]]
    assert len(set(files)) == WORLD, files  # each rank's own file, under a name unique to its save
    # The folder holds the manifest and each rank's objects: no rank record, lease or note is left.
    assert sorted(p.name for p in (saved / "ckpt-2").iterdir()) == sorted(["taskpoint.json", *files])
    payload = one["content"]["shards"][1]["content"]["payload"]
    assert sorted(p.name for p in (saved / "ckpt-1").iterdir()) == sorted(
        ["taskpoint.json", payload, one["content"]["shards"][0]["content"]["file"],
         one["content"]["shards"][2]["content"]["file"]])


def test_a_background_save_of_several_ranks_is_one_payload_per_rank_as_with_one_rank(saved: Path) -> None:
    """A background save snapshots a state dict into its ``torch.save`` bytes, a payload, as with one rank: each
    rank's part is then one payload object, and the step is of the ``sharded`` kind (version 7: by BLAKE3 pieces;
    version 6, by one BLAKE3 per shard, before 758143b)."""
    three = manifest(saved, 3)
    assert (three["version"], three["step_kind"]) == (7, "sharded")
    assert [shard["kind"] for shard in three["content"]["shards"]] == ["torch.state_dict"] * WORLD


def test_a_step_of_parts_verifies_and_describes_every_ranks_part(saved: Path) -> None:
    with CheckpointManager(saved, preemption=False) as reader:
        (checked,) = reader.verify(2).steps
        assert (checked.state, checked.kind) == ("healthy", "ranks"), checked
        described = reader.describe(1)
        assert described.kind == "ranks"
        assert [(s["rank"], s["step_kind"]) for s in described.details["shards"]] == [
            (0, "torch.state_dict"), (1, "payload"), (2, "torch.state_dict")]


def test_another_number_of_ranks_is_told_how_many_saved_the_step(saved: Path) -> None:
    with CheckpointManager(saved, preemption=False) as alone, pytest.raises(CheckpointError, match="saved by 3 ranks"):
        alone.restore(2)


def test_a_damaged_part_of_one_rank_fails_the_verification_of_the_step(saved: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpts"
    copy.mkdir()
    (copy / "ckpt-2").mkdir()
    for item in (saved / "ckpt-2").iterdir():
        (copy / "ckpt-2" / item.name).write_bytes(item.read_bytes())
    damaged = copy / "ckpt-2" / manifest(saved, 2)["content"]["shards"][2]["content"]["file"]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with CheckpointManager(copy, preemption=False) as reader:
        with pytest.raises(CheckpointCorruptError, match=damaged.name):
            reader.verify(2)
        (listed,) = reader.verify().steps  # every step: the damaged one is reported, not raised
        assert (listed.step, listed.state) == (2, "damaged"), listed


def test_deleting_a_step_of_parts_removes_every_ranks_objects(saved: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpts"
    for step in (1, 2):
        (copy / f"ckpt-{step}").mkdir(parents=True)
        for item in (saved / f"ckpt-{step}").iterdir():
            (copy / f"ckpt-{step}" / item.name).write_bytes(item.read_bytes())
    with CheckpointManager(copy, preemption=False) as manager:
        manager.delete(1)
        manager.gc(grace_seconds=0)
        assert manager.steps() == [2]
    assert not (copy / "ckpt-1").exists() or list((copy / "ckpt-1").iterdir()) == []
