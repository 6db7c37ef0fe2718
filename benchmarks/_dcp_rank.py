"""One rank of the DCP benchmark (``benchmarks/_dcp.py``): ``python -m benchmarks._dcp_rank SPEC.json``.

The runner starts WORLD_SIZE of these with torchrun's variables. Each rank holds its shard (Shard(0)) of 8 float32
DTensors over a CPU mesh, built before the clock; then, between barriers, ``dcp.save`` through the spec's writer,
and ``dcp.load`` of the same checkpoint into zeroed DTensors through the matching reader (checked after the clock).
Rank 0 writes the wall time of each operation and every rank's process CPU (all threads) to the result file.
"""

from __future__ import annotations

import datetime
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

#: Tensors in the state, and the width of each (float32 columns).
TENSORS = 8
COLUMNS = 4096


def storage(kind: str, uri: str, options: dict[str, Any]) -> tuple[Any, Any]:
    """The (writer, reader) of one compared method."""
    if kind == "taskpoint":
        import taskpoint.torch

        return (taskpoint.torch.Writer(uri, storage_options=options),
                taskpoint.torch.Reader(uri, storage_options=options))
    if kind in ("fsspec", "fsspec-t4"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        tuned = {"thread_count": 4, "sync_files": False} if kind == "fsspec-t4" else {}
        return FsspecWriter(uri, **tuned, **options), FsspecReader(uri, **options)
    if kind == "filesystem":
        return dcp.FileSystemWriter(uri), dcp.FileSystemReader(uri)
    raise ValueError(f"unknown DCP method {kind!r}")


def state(mesh: Any, rows: int, seed: int | None) -> dict[str, Any]:
    """This rank's shards: ``rows`` rows of each tensor, random from ``seed`` (zeros when None)."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for i in range(TENSORS):
        local = (torch.randn(rows, COLUMNS, generator=generator) if generator is not None
                 else torch.zeros(rows, COLUMNS))
        out[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"model": out}


def timed(fn: Any) -> tuple[float, float]:
    gc.collect()
    dist.barrier()
    wall0, cpu0 = time.monotonic(), time.process_time()
    fn()
    dist.barrier()
    return time.monotonic() - wall0, time.process_time() - cpu0


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = max(1, spec["total_bytes"] // (TENSORS * COLUMNS * 4 * world))
    saved = state(mesh, rows, seed=rank)
    writer, reader = storage(spec["method"], spec["uri"], spec["storage_options"])
    save_s, save_cpu = timed(lambda: dcp.save(saved, storage_writer=writer))
    target = state(mesh, rows, seed=None)
    load_s, load_cpu = timed(lambda: dcp.load(target, storage_reader=reader))
    same = all(torch.equal(target["model"][k].to_local(), saved["model"][k].to_local()) for k in saved["model"])
    mine = {"save_s": save_s, "save_cpu_s": save_cpu, "load_s": load_s, "load_cpu_s": load_cpu, "same": same}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps({
            "save_s": max(r["save_s"] for r in every), "save_cpu_s": sum(r["save_cpu_s"] for r in every),
            "load_s": max(r["load_s"] for r in every), "load_cpu_s": sum(r["load_cpu_s"] for r in every),
            "same": all(r["same"] for r in every), "logical_bytes": rows * COLUMNS * 4 * TENSORS * world,
        }))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
