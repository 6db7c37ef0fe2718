"""Ranks in the runtime: ctx().rank/world_size/local_rank from launchers' variables, per-rank checkpoints, lineage
that needs every rank's save, and ranks of one launch agreeing on the attempt (real processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import taskpoint
from helpers import RankProcess
from taskpoint.ranks import RANK_VARIABLES, Ranks, ranks_from_environment, resolve_ranks
from taskpoint.runtime.lineage import ActionStore


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*RANK_VARIABLES, "TASKPOINT_ROOT", "TASKPOINT_RUN_NAME", "TASKPOINT_ACTION_NAME",
                 "TASKPOINT_ATTEMPT", "TASKPOINT_CHECKPOINT_PATH", "TASKPOINT_PREV_CHECKPOINT",
                 "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "FLYTE_ATTEMPT_NUMBER"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("env", "expected"), [
    ({}, Ranks(0, 1, 0)),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, Ranks(3, 8, 1)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}, Ranks(5, 6, 2)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6"}, Ranks(5, 6, 0)),
    # torchrun under srun: the workers' ranks, not the agents'
    ({"RANK": "1", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, Ranks(1, 4, 0)),
    ({"TASKPOINT_RANK": "0", "TASKPOINT_WORLD_SIZE": "1", "RANK": "2", "WORLD_SIZE": "4"}, Ranks(0, 1, 0)),
    ({"RANK": " 2 ", "WORLD_SIZE": "4 "}, Ranks(2, 4, 0)),
], ids=["none", "torchrun", "slurm", "slurm-no-localid", "torchrun-under-srun", "override", "spaces"])
def test_ranks_come_from_the_launchers_variables(clean_env: pytest.MonkeyPatch, env: dict[str, str],
                                                 expected: Ranks) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert ranks_from_environment() == expected


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "one", "WORLD_SIZE": "4"}, r"\$RANK must be an integer, got 'one'"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "x"}, r"\$LOCAL_RANK must be an integer"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, r"\$RANK=4, \$WORLD_SIZE=4.*rank must be in 0 .. 3"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, r"world_size must be at least 1"),
    ({"TASKPOINT_RANK": "-1", "TASKPOINT_WORLD_SIZE": "2"}, r"rank must be in 0 .. 1"),
    ({"RANK": "1"}, r"\$RANK is set but \$WORLD_SIZE is not"),
    ({"TASKPOINT_WORLD_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2"}, r"\$TASKPOINT_WORLD_SIZE is set but "
                                                                      r"\$TASKPOINT_RANK is not"),
], ids=["not-int", "local-not-int", "rank-too-big", "world-zero", "negative", "half-torchrun", "half-override"])
def test_malformed_rank_variables_are_clear_errors(clean_env: pytest.MonkeyPatch, env: dict[str, str],
                                                   message: str) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        ranks_from_environment()
    with pytest.raises(ValueError, match=message):
        taskpoint.CheckpointManager("memory://never", preemption=False)


def test_manager_arguments_win_over_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    assert resolve_ranks(None, None) == Ranks(3, 4, 0)
    assert resolve_ranks(0, 1) == Ranks(0, 1)
    assert resolve_ranks(1, None) == Ranks(1, 4, 0)


def test_checkpoint_path_mode_gives_each_rank_its_own_checkpoint(clean_env: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    clean_env.setenv("TASKPOINT_CHECKPOINT_PATH", str(tmp_path / "2" / "ckpt"))
    clean_env.setenv("TASKPOINT_PREV_CHECKPOINT", str(tmp_path / "1" / "ckpt"))
    clean_env.setenv("SLURM_PROCID", "1")
    clean_env.setenv("SLURM_NTASKS", "2")
    clean_env.setenv("SLURM_LOCALID", "1")
    context = taskpoint.ctx()
    assert context is not None
    assert (context.rank, context.world_size, context.local_rank) == (1, 2, 1)
    assert context.checkpoint is not None
    assert context.checkpoint.remote_destination == str(tmp_path / "2" / "ckpt" / "rank-1")
    assert context.checkpoint.remote_source == str(tmp_path / "1" / "ckpt" / "rank-1")
    clean_env.setenv("SLURM_PROCID", "0")
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None and context.rank == 0
    assert context.checkpoint.remote_destination == str(tmp_path / "2" / "ckpt" / "rank-0")


def test_lineage_counts_an_attempt_only_when_every_rank_saved(tmp_path: Path) -> None:
    """Attempt 1: both ranks saved. Attempt 2: only rank 0 did. Attempt 3 of 4 ranks: nothing fits. So attempt 4
    (2 ranks) resumes each rank from its own shard of attempt 1; a single-rank attempt resumes from none."""
    root = str(tmp_path / "root")

    def store(rank: int, world: int) -> ActionStore:
        return ActionStore(root, "run", "train", None, ranks=Ranks(rank, world))

    def save(attempt: int, rank: int, world: int) -> None:
        checkpoint = taskpoint.Checkpoint(store(rank, world).attempt_uri(attempt))
        checkpoint.save_sync(f"attempt {attempt} rank {rank}".encode())
        checkpoint.close()

    for attempt, world, savers in ((1, 2, (0, 1)), (2, 2, (0,)), (3, 4, (0, 1, 2, 3))):
        store(0, world).begin(attempt)
        for rank in savers:
            save(attempt, rank, world)
    for rank in (0, 1):
        assert store(rank, 2).resume_source(4) == f"{root}/run/train/1/checkpoint/rank-{rank}"
        context = store(rank, 2).context(4, None)
        assert context.checkpoint is not None
        loaded = context.checkpoint.load_sync()
        assert loaded is not None and Path(loaded).read_bytes() == f"attempt 1 rank {rank}".encode()
        context.checkpoint.close()
    assert store(2, 4).resume_source(4) == f"{root}/run/train/3/checkpoint/rank-2"
    assert store(0, 1).resume_source(4) is None  # the single-rank layout: no attempt saved {n}/checkpoint


def _launch(mode: str, args: dict[str, Any], world: int, env: dict[str, str]) -> list[dict[str, Any]]:
    """Start ``world`` ranks at once, wait for them all, return each one's events."""
    ranks = [RankProcess(mode, args, rank, world, env) for rank in range(world)]
    try:
        for proc in ranks:
            assert proc.finish(90) == 0, proc.stderr_tail()
        return [proc.events for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()


@pytest.mark.e2e("starts rank processes")
def test_ranks_started_at_once_agree_on_the_attempt(tmp_path: Path) -> None:
    """Three launches of 3 ranks each, every rank started at the same moment, in root mode: all ranks of a
    launch get the same attempt, the next free one; TASKPOINT_ATTEMPT is taken as given, without a rendezvous."""
    env = {"TASKPOINT_ROOT": str(tmp_path / "root"), "TASKPOINT_RUN_NAME": "job", "TASKPOINT_ACTION_NAME": "main",
           "TASKPOINT_RENDEZVOUS_TIMEOUT": "60"}
    for launch in (1, 2):
        events = _launch("ctx", {}, 3, env)
        assert [e[0]["attempt"] for e in events] == [launch] * 3
        assert [(e[0]["rank"], e[0]["world_size"]) for e in events] == [(0, 3), (1, 3), (2, 3)]
    events = _launch("ctx", {}, 3, {**env, "TASKPOINT_ATTEMPT": "7"})
    assert [e[0]["attempt"] for e in events] == [7] * 3
    markers = sorted(p.parent.name for p in (tmp_path / "root" / "job" / "main").glob("*/attempt.json"))
    assert markers == ["1", "2", "7"]


@pytest.mark.e2e("starts rank processes")
def test_killed_two_rank_task_resumes_every_rank_from_the_same_step(tmp_path: Path) -> None:
    """A 2-rank @taskpoint.task job saves steps 1-3 (a shard per rank, and ctx().checkpoint), then both ranks
    are SIGKILLed. Relaunched, both ranks agree on attempt 2, resume from step 3, each from its own shard and
    its own checkpoint of attempt 1, and finish."""
    env = {"TASKPOINT_RENDEZVOUS_TIMEOUT": "60"}
    args = {"root": str(tmp_path / "root"), "run_name": "job", "until": 3, "hang": True}
    ranks = [RankProcess("job", args, rank, 2, env) for rank in range(2)]
    try:
        for proc in ranks:
            proc.wait_for("saved", step=3, timeout=90)
    finally:
        for proc in ranks:
            proc.kill()
    assert [proc.process.returncode for proc in ranks] == [-9, -9]
    events = _launch("job", {**args, "until": 5, "hang": False}, 2, env)
    for rank, seen in enumerate(events):
        resumed = next(e for e in seen if e["event"] == "resumed")
        assert resumed == {"event": "resumed", "rank": rank, "attempt": 2, "latest": 3,
                           "restored": f"rank={rank} step=3", "checkpoint": f"rank={rank} attempt=1 step=3"}
        assert [e["step"] for e in seen if e["event"] == "saved"] == [4, 5]
        assert seen[-1] == {"event": "done"}
