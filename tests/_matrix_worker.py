"""One rank of the 3-rank job of tests/e2e/test_manager_matrix.py, started by the real ``torchrun`` (gloo, CPU).

The argument is one JSON object: ``base`` and ``options`` (the remote store: each cell a folder of ``base``),
``local`` (the node folders: each rank its own in it, as each node has its own disk) and ``cells`` (their ids,
run in that order by the one process group, :func:`_matrix_cells.run_cell`). Rank 0 prints each cell's outcome
as one JSON line, in one write, as soon as the cell ends (so a job cut short still tells which cells ended), then
``{"event": "done"}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from _matrix_cells import GROUP_TIMEOUT, Where, cells, import_kinds, run_cell


class Ranks:
    """The job's gloo group, as :class:`_matrix_cells.Group`."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def gather(self, value: Any) -> list[Any]:
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        dist.barrier()


def say(**event: Any) -> None:
    """One JSON line in one write (the ranks share torchrun's stdout)."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> None:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    group = Ranks()
    import_kinds()
    group.barrier()  # every rank has its extras imported before the first cell
    where = Where(args["base"], args["options"], Path(args["local"]))
    chosen = {cell.id: cell for cell in cells(group.world)}
    for name in args["cells"]:
        outcome = run_cell(chosen[name], where, group)
        if group.rank == 0:
            say(**outcome)
    dist.barrier()
    dist.destroy_process_group()
    if group.rank == 0:
        say(event="done")
    # No interpreter shutdown: torch's gloo (2.13) can abort a rank at exit. A core of a rank that did (SIGABRT,
    # "terminate called without an active exception", 2 of 12 launches beside two CPU burners) showed the main
    # thread in Py_FinalizeEx while a gloo worker thread destroyed the job's last barrier work, which still held an
    # all-gather's tensors; their decref took the GIL, and a thread taking it during finalization is made to exit
    # (pthread_exit) inside a noexcept destructor: std::terminate. Every cell has ended and been reported here.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
