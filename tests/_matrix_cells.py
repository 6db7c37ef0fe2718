"""One cell of issue 41's matrix (kind x ranks x tier), run through the public API only, for
tests/e2e/test_manager_matrix.py (one rank, in the test's process) and tests/_matrix_worker.py (3 ranks under torchrun).

A cell makes its manager on every rank (and, for a kind saved through a writer of its own, DCP's, that writer: the
manager cannot see such a writer coming, so the writer's construction, before anything is stored, is where it
refuses a combination), saves steps 1 and 2 of its kind, restores the newest, and with a local tier also restores
it from each tier alone (from the local copies, with a remote tier that never held the step; and from the remote
tier, on a node whose local folder is empty), verifies, deletes step 1, runs gc(), and lists what is left in
storage: nothing but step 2's objects may remain. Every stage runs on every rank together; after each, the ranks
exchange their errors, so that all stop at the first stage any rank failed (none waits in a collective for a rank
that gave up). Its outcome is one JSON-able dict: ``works``; ``refused`` (a constructor raised ValueError: its
message); or ``failed`` at a stage, with each rank's error there.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import fsspec

from helpers import fs_options
from taskpoint import CheckpointManager

KINDS = ("payload", "dedup", "state_dict", "pytree", "dcp")
RANKS = (1, 3)
TIERS = ("none", "local")
#: Rank 0's wait for the other ranks' shards, and the grace before a leftover is swept (which must be longer):
#: bounded below the gloo group's timeout, so that a rank that never saved fails the cell, not the job.
COMMIT_TIMEOUT, GRACE = 120.0, 240.0
#: The gloo group's timeout (seconds): every collective of a cell, and the ranks' exchange after each stage.
GROUP_TIMEOUT = datetime.timedelta(seconds=300)
#: Objects of a directory that belong to no step: the fence that every sweep of a chunk store rewrites.
BOOKKEEPING = frozenset({"leases/epoch"})
#: The step kind one rank's step of these kinds is: with several ranks, the kind each rank's part is stored as.
OWN_KINDS = {"state_dict": "torch.state_dict", "pytree": "jax.pytree"}


@dataclass(frozen=True)
class Cell:
    """One combination: what a step holds, how many ranks write it, where it lives."""

    kind: str
    ranks: int
    tier: str

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.ranks}rank-{self.tier}"


def cells(ranks: int | None = None) -> list[Cell]:
    """Every cell (of ``ranks`` ranks, when given), in the order the matrix lists them."""
    return [Cell(kind, count, tier) for kind in KINDS for count in RANKS for tier in TIERS
            if ranks is None or count == ranks]


class Group(Protocol):
    """The ranks running a cell together: this one's rank, and an exchange of one value with every rank."""

    rank: int
    world: int

    def gather(self, value: Any) -> list[Any]: ...

    def barrier(self) -> None: ...


class Alone:
    """One rank: nothing to exchange."""

    rank, world = 0, 1

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def barrier(self) -> None:
        pass


class StageFailed(Exception):
    """A stage failed on at least one rank: each rank's error (None where it passed)."""

    def __init__(self, stage: str, errors: list[str | None]) -> None:
        super().__init__(stage)
        self.stage, self.errors = stage, errors


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of ``exc``; for DCP's CheckpointException (which wraps each rank's error), the first
    rank's error inside it."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    return f"{type(exc).__name__}: {exc}"[:600]


def run_stage(group: Group, stage: str, action: Callable[[], None]) -> None:
    """Run ``action`` on every rank, then exchange errors: StageFailed on every rank when any rank failed."""
    error = None
    try:
        action()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        error = describe_error(exc)
    errors = group.gather(error)
    if any(errors):
        raise StageFailed(stage, errors)


def one_rank_at_a_time(group: Group, action: Callable[[], object]) -> Callable[[], None]:
    """``action`` run by rank 0, then rank 1, ... (a barrier between them): ``delete`` and ``gc`` of a step
    every rank's tier holds, without two ranks removing the same objects at once."""
    def turns() -> None:
        error: Exception | None = None
        for turn in range(group.world):
            if turn == group.rank:
                try:
                    action()
                except Exception as exc:
                    error = exc
            group.barrier()
        if error is not None:
            raise error
    return turns


# -- what each kind saves and loads ---------------------------------------------------------------------------

def import_kinds() -> None:
    """Import the extras the kinds save and load through (torch, DCP, jax with Orbax): seconds each on a busy
    machine, which a rank should spend before its first cell, not while rank 0 waits for its shard."""
    for name in ("torch.distributed.checkpoint", "taskpoint.torch", "taskpoint.jax"):
        importlib.import_module(name)


def expected(kind: str, rank: int, step: int) -> Any:
    """What rank ``rank`` reads back of ``step``, in the plain form :func:`load_newest` returns."""
    if kind == "payload":
        return f"payload of rank {rank} at step {step} ".encode() * 200
    if kind == "dedup":  # one file the same in every step (one chunk, shared), one of each step's own
        return {"base.bin": bytes(range(256)) * 64 + bytes([rank]), "step.txt": f"rank {rank} step {step}".encode()}
    return [float(step * 10 + rank)] * 16


def data(kind: str, rank: int, step: int, workspace: Path) -> Any:
    """What ``manager.save`` is given for this kind (DCP saves through its own writer instead)."""
    value = expected(kind, rank, step)
    if kind == "payload":
        return value
    if kind == "dedup":
        folder = workspace / f"rank-{rank}-step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        for name, body in value.items():
            (folder / name).write_bytes(body)
        return folder
    if kind == "state_dict":
        import torch

        from taskpoint.torch import StateDict

        return StateDict({"w": torch.tensor(value), "step": step})
    import numpy as np

    from taskpoint.jax import PyTree

    return PyTree({"w": np.asarray(value, dtype=np.float32), "step": step})


def save(kind: str, manager: CheckpointManager, rank: int, step: int, workspace: Path) -> None:
    """Save this rank's ``step`` of ``kind`` through ``manager`` (every rank together)."""
    if kind != "dcp":
        manager.save(data(kind, rank, step, workspace), step)
        return
    import torch
    import torch.distributed.checkpoint as dcp

    from taskpoint.torch import Writer

    state = {f"w{rank}": torch.tensor(expected(kind, rank, step))}  # one key per rank: DCP keeps each rank's own
    dcp.save(state, storage_writer=Writer.for_step(manager, step))


def construct_writer(kind: str, manager: CheckpointManager) -> None:
    """Make the writer that ``kind`` saves its first step through, when it has one of its own (DCP's): ValueError
    when the writer refuses the manager's combination."""
    if kind == "dcp":
        from taskpoint.torch import Writer

        Writer.for_step(manager, 1)


def load_newest(kind: str, manager: CheckpointManager, rank: int) -> Any:
    """The newest step of ``kind`` as this rank reads it back through ``manager``, with the kind's own reader."""
    if kind == "payload":
        return manager.restore().read_bytes()
    if kind == "dedup":
        folder = manager.restore()
        return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}
    if kind == "state_dict":
        from taskpoint.torch import load_state_dict_sync

        state = load_state_dict_sync(manager)
        assert state is not None, f"no step in {manager.directory}"
        return state["w"].tolist()
    if kind == "pytree":
        from taskpoint.jax import load_pytree_sync

        return [float(x) for x in load_pytree_sync(manager)["w"]]
    import torch
    import torch.distributed.checkpoint as dcp

    from taskpoint.torch import Reader

    state = {f"w{rank}": torch.zeros(16)}
    dcp.load(state, storage_reader=Reader.for_step(manager))
    return state[f"w{rank}"].tolist()


# -- the cell -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Where:
    """Where a cell keeps its steps: the remote directory's base URL (each cell a folder of it), its storage
    options, and this node's local folder (each rank its own, as each node has its own disk)."""

    base: str
    options: dict[str, Any]
    local: Path

    def remote(self, cell: Cell, name: str = "ckpts") -> str:
        return f"{self.base.rstrip('/')}/{cell.id}/{name}"

    def node(self, cell: Cell, rank: int, name: str = "node") -> Path:
        return self.local / cell.id / f"{name}-rank-{rank}"


def open_manager(cell: Cell, where: Where, group: Group, *, remote: str = "ckpts", node: str = "node"
                 ) -> CheckpointManager:
    """The cell's manager on this rank: ``remote`` names its directory, ``node`` its local folder."""
    tier: dict[str, Any] = ({"local_dir": str(where.node(cell, group.rank, node)), "remote_every": 1}
                            if cell.tier == "local" else {})
    return CheckpointManager(where.remote(cell, remote), storage_options=where.options, preemption=False,
                             dedup=cell.kind == "dedup", rank=group.rank, world_size=cell.ranks,
                             commit_timeout=COMMIT_TIMEOUT, grace_seconds=GRACE, **tier)


def stored(url: str, options: dict[str, Any]) -> set[str]:
    """Every object under ``url``, by its path relative to it (fsspec's own listing, not taskpoint's)."""
    fs, root = fsspec.core.url_to_fs(url, **fs_options(options))
    fs.invalidate_cache()
    if not fs.exists(root):
        return set()
    return {path[len(root.rstrip("/")) + 1:] for path in fs.find(root)}


def remote_parts(url: str, options: dict[str, Any], step: int) -> list[str | None]:
    """The step kind of each rank's part of ``step`` as the remote manifest records it (read with fsspec, not
    taskpoint): a ``ranks`` step names each; any other step, none."""
    fs, root = fsspec.core.url_to_fs(url, **fs_options(options))
    fs.invalidate_cache()
    doc = json.loads(fs.cat_file(f"{root.rstrip('/')}/ckpt-{step}/taskpoint.json"))
    if doc.get("step_kind") != "ranks":
        return [None]
    return [shard.get("step_kind") for shard in doc["content"]["shards"]]


def leftovers(manager: CheckpointManager, objects: set[str], step: int) -> list[str]:
    """The ``objects`` of a directory that are not ``step``'s: anything outside its folder but the chunk store
    and the directory's bookkeeping; chunks beyond the ones its manifest names (by count: a description lists
    how many); and whatever :meth:`inventory` finds in its folder that no manifest names."""
    outside = sorted(name for name in objects if not name.startswith((f"ckpt-{step}/", "chunks/"))
                     and name not in BOOKKEEPING)
    chunks = sorted(name for name in objects if name.startswith("chunks/"))
    named = manager.describe(step).details.get("unique_chunks", 0)
    extra_chunks = [f"{len(chunks)} chunks where step {step} names {named}"] if len(chunks) != named else []
    inside = [name for summary in manager.inventory() for name in summary.leftovers]
    return outside + extra_chunks + inside


@contextlib.contextmanager
def _closing(managers: list[CheckpointManager]) -> Iterator[None]:
    try:
        yield
    finally:
        for manager in managers:
            with contextlib.suppress(BaseException):
                manager.close()


def run_cell(cell: Cell, where: Where, group: Group) -> dict[str, Any]:
    """Run ``cell`` on every rank of ``group`` together; its outcome (the same on every rank)."""
    managers: list[CheckpointManager] = []
    try:
        with _closing(managers):
            refusals = _construct(cell, where, group, managers)
            if refusals is not None:
                return {"cell": cell.id, "outcome": "refused", "errors": refusals}
            _stages(cell, where, group, managers[0], managers)
    except StageFailed as failed:
        return {"cell": cell.id, "outcome": "failed", "stage": failed.stage, "errors": failed.errors}
    return {"cell": cell.id, "outcome": "works"}


def _construct(cell: Cell, where: Where, group: Group, managers: list[CheckpointManager]) -> list[str] | None:
    """Make the cell's manager on every rank (into ``managers``), and its kind's writer (:func:`construct_writer`):
    each rank's ValueError message when every rank refused, None when none did; StageFailed when a rank failed
    otherwise, or the ranks disagree."""
    refusal = error = None
    try:
        managers.append(open_manager(cell, where, group))
        construct_writer(cell.kind, managers[-1])
    except ValueError as exc:
        refusal = str(exc)
    except Exception as exc:
        error = describe_error(exc)
    answers = group.gather((refusal, error))
    if all(refused is not None for refused, _ in answers):
        return [refused for refused, _ in answers]
    if any(refused is not None or failed is not None for refused, failed in answers):
        raise StageFailed("construct", [failed or (refused and f"ValueError: {refused}")
                                        for refused, failed in answers])
    return None


def _stages(cell: Cell, where: Where, group: Group, manager: CheckpointManager,
            managers: list[CheckpointManager]) -> None:
    rank, kind, tiered = group.rank, cell.kind, cell.tier == "local"
    workspace = where.node(cell, rank, "data")

    def save_two() -> None:
        for step in (1, 2):
            save(kind, manager, rank, step, workspace)
        manager.wait_until_finished()
        group.barrier()  # every rank's saves returned: rank 0's commits are done
        assert manager.steps() == [1, 2], manager.steps()
        if tiered:
            tiers = {tier: manager.steps(tier=tier) for tier in ("local", "remote")}
            assert tiers == {"local": [1, 2], "remote": [1, 2]}, f"steps by tier after two saves: {tiers}"
        if cell.ranks > 1 and kind in OWN_KINDS:
            assert remote_parts(where.remote(cell), where.options, 2) == [OWN_KINDS[kind]] * cell.ranks

    def check(source: CheckpointManager) -> None:  # the newest step is step 2, this rank's state of it
        got = load_newest(kind, source, rank)
        assert got == expected(kind, rank, 2), f"the newest step read back as {str(got)[:200]}"

    def from_local_tier() -> None:  # the local copies alone: a remote tier that never held the step
        alone = open_manager(cell, where, group, remote="empty-remote")
        managers.append(alone)
        assert alone.steps(tier="remote") == [] and 2 in alone.steps(tier="local"), alone.steps()
        check(alone)

    def from_remote_tier() -> None:  # a replaced node: its local folder is empty
        fresh = open_manager(cell, where, group, node="new-node")
        managers.append(fresh)
        assert fresh.steps(tier="local") == [] and fresh.steps(tier="remote") == [1, 2], fresh.steps()
        check(fresh)

    def verify() -> None:
        report = manager.verify(2)
        assert report.healthy, report

    def left() -> None:
        remote = stored(where.remote(cell), where.options)
        extra = leftovers(manager, remote, 2) if rank == 0 else []
        if tiered:
            node = where.node(cell, rank)
            extra += [f"local: {name}" for name in sorted(stored(str(node), {})) if not name.startswith("ckpt-2/")]
            with CheckpointManager(node, preemption=False, rank=0, world_size=1) as local:  # the tier as it lies
                extra += [f"local: {name}" for summary in local.inventory() for name in summary.leftovers]
            assert manager.steps(tier="local") == [2], manager.steps(tier="local")
        assert manager.steps() == [2], manager.steps()
        assert not extra, f"left in storage besides step 2: {extra}"

    run_stage(group, "save", save_two)
    run_stage(group, "restore", lambda: check(manager))
    if tiered:
        run_stage(group, "restore from the local tier", from_local_tier)
        run_stage(group, "restore from the remote tier", from_remote_tier)
    run_stage(group, "verify", verify)
    # One rank deletes the step for all; with a local tier every rank also drops its own local copy.
    deletes = tiered or rank == 0
    run_stage(group, "delete", one_rank_at_a_time(group, lambda: manager.delete(1) if deletes else None))
    run_stage(group, "gc", one_rank_at_a_time(group, lambda: manager.gc(grace_seconds=0)))
    run_stage(group, "left in storage", left)
