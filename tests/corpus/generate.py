"""Write small stored checkpoints with whatever taskpoint is on ``PYTHONPATH`` (an old commit's ``src``), for the
corpus of stored formats (README.md says which commit wrote which folder, and how).

    PYTHONPATH=/tmp/old-REV/src python tests/corpus/generate.py OUT WHAT [WHAT ...]

Each WHAT writes ``OUT/WHAT/``; only the public API of the time is used. The contents are fixed (bytes, a small
tree, a small tensor), so the test knows what each must restore to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BYTES = b"taskpoint corpus: the bytes of a bytes payload\n" * 4
#: The tree of a directory payload: relative path -> bytes.
TREE = {"a.txt": b"alpha\n" * 8, "sub/b.bin": bytes(range(256)) * 3, "sub/deeper/c.txt": b"gamma\n"}
METADATA = {"loss": 0.5, "corpus": True}


def write_tree(root: Path) -> Path:
    for rel, data in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def checkpoint_bytes(out: Path, scratch: Path) -> None:
    import taskpoint

    taskpoint.Checkpoint(str(out / "ckpt")).save_sync(BYTES)


def checkpoint_directory(out: Path, scratch: Path) -> None:
    import taskpoint

    taskpoint.Checkpoint(str(out / "ckpt")).save_sync(write_tree(scratch / "tree"))


def step_payload(out: Path, scratch: Path) -> None:
    import taskpoint

    with taskpoint.CheckpointManager(str(out / "steps")) as manager:
        manager.save(BYTES, 1, metadata=METADATA)
        manager.save(write_tree(scratch / "tree"), 2, metadata=METADATA)


def step_chunked(out: Path, scratch: Path) -> None:
    import taskpoint

    with taskpoint.CheckpointManager(str(out / "steps"), dedup=True) as manager:
        manager.save(write_tree(scratch / "tree"), 1, metadata=METADATA)


def _ranks(out: Path, step: int, ranks: list[int]) -> None:
    """Save ``step`` from each of ``ranks`` (of 2), each its own process, at once."""
    env = {**os.environ, "TASKPOINT_CORPUS_RANKS": "1"}
    children = [subprocess.Popen([sys.executable, __file__, str(out), f"rank:{rank}:{step}"], env=env)
                for rank in ranks]
    for child in children:
        if child.wait(timeout=120) != 0:
            raise SystemExit(f"rank process failed: {child.args}")


def rank_save(out: Path, rank: int, step: int) -> None:
    import taskpoint

    with taskpoint.CheckpointManager(str(out / "steps"), rank=rank, world_size=2, commit_timeout=60) as manager:
        manager.save(BYTES + bytes([rank]), step, metadata=METADATA)


def step_sharded(out: Path, scratch: Path) -> None:
    _ranks(out, 1, [0, 1])


def shard_record(out: Path, scratch: Path) -> None:
    """Rank 1 alone: its payload and its record stay in the uncommitted step's folder."""
    _ranks(out, 1, [1])


def _small_state() -> dict[str, object]:
    import torch

    return {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(3, dtype=torch.int64)}


#: The ranks of the ``step_ranks`` sample, and what each saves: a state dict (ranks 0 and 1), bytes (rank 2).
RANKS_WORLD = 3


def ranks_state(rank: int) -> dict[str, object]:
    """The state dict rank ``rank`` of the ``step_ranks`` sample saves."""
    import torch

    return {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8) + rank, "b": torch.full((3,), rank)}


def step_ranks(out: Path, scratch: Path) -> None:
    """A ``ranks`` step: 3 real ranks under torchrun (``--standalone``; the manager reads RANK and WORLD_SIZE and
    commits through storage, no process group needed), whose parts are not all payloads."""
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={RANKS_WORLD}", __file__, str(out),
                           "ranks_part"], timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"torchrun failed: {done.args}")


def ranks_part(out: Path) -> None:
    """One rank of :func:`step_ranks` (under torchrun): ranks 0 and 1 a state dict, rank 2 bytes, as step 1."""
    import taskpoint
    import taskpoint.torch

    rank = int(os.environ["RANK"])
    payload = BYTES + bytes([rank]) if rank == RANKS_WORLD - 1 else taskpoint.torch.StateDict(ranks_state(rank))
    with taskpoint.CheckpointManager(str(out / "steps"), commit_timeout=120) as manager:
        manager.save(payload, 1, metadata=METADATA)


def step_dcp(out: Path, scratch: Path) -> None:
    import torch.distributed.checkpoint as dcp

    import taskpoint
    import taskpoint.torch

    with taskpoint.CheckpointManager(str(out / "steps")) as manager:
        dcp.save(_small_state(), storage_writer=taskpoint.torch.Writer.for_step(manager, 1, metadata=METADATA))


def step_state_dict(out: Path, scratch: Path) -> None:
    import taskpoint
    import taskpoint.torch

    with taskpoint.CheckpointManager(str(out / "steps")) as manager:
        manager.save(taskpoint.torch.StateDict(_small_state()), 1, metadata=METADATA)


def step_pytree(out: Path, scratch: Path) -> None:
    import numpy as np

    import taskpoint
    import taskpoint.jax

    tree = {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, "step": 7, "name": "corpus"}
    with taskpoint.CheckpointManager(str(out / "steps")) as manager:
        manager.save(taskpoint.jax.PyTree(tree), 1, metadata=METADATA)


WRITERS = {"checkpoint_bytes": checkpoint_bytes, "checkpoint_directory": checkpoint_directory,
           "step_payload": step_payload, "step_chunked": step_chunked, "step_sharded": step_sharded,
           "shard_record": shard_record, "step_dcp": step_dcp, "step_state_dict": step_state_dict,
           "step_pytree": step_pytree, "step_ranks": step_ranks}


def main(out: Path, whats: list[str]) -> None:
    import tempfile

    for what in whats:
        if what.startswith("rank:"):
            _, rank, step = what.split(":")
            rank_save(out, int(rank), int(step))
            continue
        if what == "ranks_part":
            ranks_part(out)
            continue
        target = out / what
        target.mkdir(parents=True)
        with tempfile.TemporaryDirectory() as scratch:
            WRITERS[what](target, Path(scratch))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
