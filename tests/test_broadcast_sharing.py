"""Which ranks of a broadcast restore share which objects (issue 44 item 4): those that read the same object of the
same step of the same directory, each set of them on its own; the answer is the same on every rank."""

from __future__ import annotations

from taskpoint.manager.broadcast import _sharing


def said(directory: str, step: int, objects: dict[str, int], save: str = "s1") -> list[object]:
    """What one rank says its restore reads (as the all-gather carries it)."""
    return [directory, step, save, objects]


def test_every_rank_restoring_one_step_shares_all_of_it():
    everyone = [said("s3://b/run", 7, {"payload-x": 100, "extra": 5})] * 4
    assert _sharing(everyone) == [([0, 1, 2, 3], ["extra", "payload-x"])]


def test_the_replicas_of_each_pipeline_stage_share_their_stage_alone():
    a, b = said("s3://b/stage-a", 7, {"payload-a": 100}), said("s3://b/stage-b", 7, {"payload-b": 50})
    assert _sharing([a, b, a, b]) == [([0, 2], ["payload-a"]), ([1, 3], ["payload-b"])]


def test_ranks_that_each_read_their_own_shard_share_nothing():
    assert _sharing([said("s3://b/run", 7, {f"shard-{rank}": 10}) for rank in range(4)]) == []


def test_another_step_save_or_size_is_another_object():
    base = said("s3://b/run", 7, {"payload": 100})
    others = [said("s3://b/run", 8, {"payload": 100}), said("s3://b/run", 7, {"payload": 100}, save="s2"),
              said("s3://b/run", 7, {"payload": 99})]
    for other in others:
        assert _sharing([base, other]) == []
    assert _sharing([base, others[0], base, None]) == [([0, 2], ["payload"])]  # None: a rank reading chunks
