"""One rank of a gloo job on CPU for tests/e2e/test_torch_dcp.py: ``python tests/_dcp_worker.py ACTIONS_JSON``.

The launcher sets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). The model's
parameters are DTensors over a 1-D CPU mesh of every rank (weights sharded on dim 0, one bias replicated), built
from a seed so that any rank count can rebuild the full tensors it expects. ACTIONS_JSON is a list of
``[action, uri]`` run in order by the one process group:

- ``save``, ``async_save``: the model and a little non-tensor state through ``taskpoint.torch.Writer``;
- ``load``: through ``taskpoint.torch.Reader``, then every tensor checked bit for bit, and the other state;
- ``wait_for``: until another job has committed a checkpoint there;
- ``save_dies``: rank 2 is SIGKILLed in the middle of its upload; the others exit with status 3 once the
  save fails.

``STORAGE_OPTIONS`` (JSON) is passed to the Writer and Reader.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import taskpoint.torch

SEED = 1234


def build_model(seed: int | None) -> nn.Module:
    """The test model on every rank: real values from ``seed``, or zeros (a load's target) when None."""
    if seed is not None:
        torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 30), nn.ReLU(), nn.Linear(30, 22), nn.Linear(22, 3, bias=False))
    if seed is None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return model


def distribute(model: nn.Module, mesh: object) -> nn.Module:
    """Weights sharded on dim 0 over every rank (uneven shards: 30, 22 and 3 rows), the last bias replicated."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            placement = Replicate() if (name == "bias" and param.shape[0] == 22) else Shard(0)
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), mesh, [placement])))
    return model


def state_of(model: nn.Module, step: int) -> dict[str, object]:
    return {"model": model.state_dict(), "extra": {"step": step, "note": "taskpoint"}}


def check_loaded(state: dict[str, object], step: int) -> None:
    expected = build_model(SEED).state_dict()
    model_state = state["model"]
    assert isinstance(model_state, dict)
    for key, value in model_state.items():
        assert isinstance(value, DTensor), key
        full = value.full_tensor()
        want = expected[key]
        assert full.dtype == want.dtype and full.shape == want.shape, key
        assert torch.equal(full.view(torch.int32), want.view(torch.int32)), f"{key} differs after the load"
    assert state["extra"] == {"step": step, "note": "taskpoint"}, state["extra"]


class DiesMidUpload(DefaultSavePlanner):
    """Kills its own process (SIGKILL, no cleanup) when the writer asks for the second item: by then the
    rank's first file is open and partly written."""

    resolved = 0

    def resolve_data(self, write_item: Any) -> Any:
        self.resolved += 1
        if self.resolved == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def save_dies(mesh: object, uri: str, options: dict[str, Any]) -> None:
    """Rank 2 is killed in the middle of its upload; the others must see the save fail (exit status 3)."""
    planner = DiesMidUpload() if dist.get_rank() == 2 else None
    try:
        dcp.save(state_of(distribute(build_model(SEED), mesh), 7), planner=planner,
                 storage_writer=taskpoint.torch.Writer(uri, storage_options=options, threads=1))
    except BaseException as exc:
        print(f"the save failed as it should: {type(exc).__name__}", flush=True)
        os._exit(3)  # the group lost a rank: no barrier, no teardown
    raise AssertionError("the save succeeded although rank 2 was killed")


def wait_for_commit(uri: str, options: dict[str, Any], timeout: float = 180.0) -> None:
    """Until another job has committed a checkpoint at ``uri`` (its ``.metadata`` exists)."""
    import time

    import fsspec

    fs, path = fsspec.core.url_to_fs(uri, **options)
    deadline = time.monotonic() + timeout
    while not fs.exists(f"{path}/.metadata"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint was committed at {uri} within {timeout:g} s")
        time.sleep(0.2)
        fs.invalidate_cache()


def main() -> None:
    actions = json.loads(sys.argv[1])
    options = json.loads(os.environ.get("STORAGE_OPTIONS", "{}"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("GLOO_TIMEOUT", "90"))))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        for action, uri in actions:
            if action == "save":
                dcp.save(state_of(distribute(build_model(SEED), mesh), 7),
                         storage_writer=taskpoint.torch.Writer(uri, storage_options=options))
            elif action == "async_save":
                future = dcp.async_save(state_of(distribute(build_model(SEED), mesh), 7),
                                        storage_writer=taskpoint.torch.Writer(uri, storage_options=options))
                future.result(timeout=120)
            elif action == "wait_for":
                wait_for_commit(uri, options)
            elif action == "save_dies":
                save_dies(mesh, uri, options)
            elif action == "load":
                state = state_of(distribute(build_model(None), mesh), 0)
                dcp.load(state, storage_reader=taskpoint.torch.Reader(uri, storage_options=options))
                check_loaded(state, 7)
            else:
                raise ValueError(f"unknown action {action}")
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
