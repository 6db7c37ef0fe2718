"""Train a small PyTorch model in an ``async`` task that resumes from its last saved epoch.

After every epoch the task writes ``model.pt``, ``optimizer.pt``, ``rng.pt`` and ``progress.json`` to a
folder and saves the folder with ``await ctx().checkpoint.save(folder)``. An attempt that follows a failure
loads that folder, restores the model, the optimizer and the random-number state, and continues with the
next epoch. Shuffling and dropout draw from the restored state, so a run that failed and resumed ends with
the same weights, bit for bit, as a run that never failed.

    python examples/pytorch_task_checkpoint.py                                     # one attempt
    python examples/pytorch_task_checkpoint.py --fail-at-epoch 2 --fail-at-epoch 5   # resumes twice

Epochs count from 0, as in PyTorch Lightning. ``--root`` and ``--run-name`` set ``TASKPOINT_ROOT`` and
``TASKPOINT_RUN_NAME``; a process started again with the same run name continues that run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import taskpoint

SEED = 0
SAMPLES = 256
FEATURES = 8
HIDDEN = 16
BATCH_SIZE = 32
LEARNING_RATE = 0.01
RETRIES = 3
DEFAULT_EPOCHS = 8

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
PROGRESS_FILE = "progress.json"


class SimulatedFailure(RuntimeError):
    """Raised on purpose after an epoch's save, to show the next attempt resuming."""


@dataclass
class Training:
    """Everything an epoch changes: the model and the optimizer (the global RNG is the third part)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor


def new_training() -> Training:
    """A fresh model, optimizer and synthetic regression data, all from fixed seeds."""
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(HIDDEN, 1)
    )
    data = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(SAMPLES, FEATURES, generator=data)
    y = x @ torch.randn(FEATURES, 1, generator=data) + 0.1 * torch.randn(SAMPLES, 1, generator=data)
    return Training(model, torch.optim.Adam(model.parameters(), lr=LEARNING_RATE), x, y)


def train_epoch(t: Training) -> float:
    """One pass over the data in an order drawn from the global RNG; returns the mean loss."""
    t.model.train()
    order = torch.randperm(SAMPLES)
    total = 0.0
    for batch in order.split(BATCH_SIZE):
        t.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(t.model(t.x[batch]), t.y[batch])
        loss.backward()
        t.optimizer.step()
        total += loss.item() * len(batch)
    return total / SAMPLES


# --8<-- [start:state]
def write_state(folder: Path, t: Training, epoch: int, loss: float) -> None:
    torch.save(t.model.state_dict(), folder / MODEL_FILE)
    torch.save(t.optimizer.state_dict(), folder / OPTIMIZER_FILE)
    torch.save(torch.get_rng_state(), folder / RNG_FILE)
    (folder / PROGRESS_FILE).write_text(json.dumps({"epoch": epoch, "loss": loss}))


def restore_state(folder: Path, t: Training) -> int:
    """Load what :func:`write_state` wrote; returns the epoch to run next."""
    t.model.load_state_dict(torch.load(folder / MODEL_FILE, weights_only=True))
    t.optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True))
    torch.set_rng_state(torch.load(folder / RNG_FILE, weights_only=True))
    return int(json.loads((folder / PROGRESS_FILE).read_text())["epoch"]) + 1
# --8<-- [end:state]


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests mean bit-for-bit equal weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --8<-- [start:task]
@taskpoint.task(retries=RETRIES)
async def train(epochs: int, fail_at_epochs: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Train for ``epochs`` epochs, saving after each; raise once after saving each epoch in ``fail_at_epochs``."""
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    checkpoint = context.checkpoint
    t = new_training()
    # The attempt's local workspace: a previous attempt's folder is loaded into it, and each epoch's files
    # are written over it before it is saved again.
    folder = checkpoint.path
    start = 0
    if await checkpoint.load() is not None:
        start = restore_state(folder, t)
        print(f"attempt {context.attempt}: resumed at epoch {start} (run {context.run_name})", flush=True)
    else:
        print(f"attempt {context.attempt}: started at epoch 0 (run {context.run_name})", flush=True)

    loss = float("nan")
    for epoch in range(start, epochs):
        # Blocking work runs in a worker thread so the event loop stays free.
        loss = await asyncio.to_thread(train_epoch, t)
        await asyncio.to_thread(write_state, folder, t, epoch, loss)
        began = time.perf_counter()
        await checkpoint.save(folder)
        print(f"epoch {epoch}: loss {loss:.6f}, saved in {time.perf_counter() - began:.3f} s", flush=True)
        if epoch in fail_at_epochs:
            print(f"attempt {context.attempt}: failing on purpose after saving epoch {epoch}", flush=True)
            raise SimulatedFailure(f"simulated failure after epoch {epoch}")

    return {"epochs": epochs, "loss": loss, "attempt": context.attempt, "sha256": weights_digest(t.model),
            "weights": {name: p.tolist() for name, p in t.model.state_dict().items()}}
# --8<-- [end:task]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="epochs to train (default %(default)s)")
    parser.add_argument("--fail-at-epoch", type=int, action="append", default=[], metavar="E",
                        help="raise after saving epoch E (once; repeat the flag for more failures)")
    parser.add_argument("--root", help="storage root, any fsspec URL (sets TASKPOINT_ROOT)")
    parser.add_argument("--run-name", help="name of the run to start or continue (sets TASKPOINT_RUN_NAME)")
    parser.add_argument("--out", type=Path, help="write the final loss and weights to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The task reads these when it is called, so the flags need no second way to configure it.
    if args.root:
        os.environ["TASKPOINT_ROOT"] = args.root
    if args.run_name:
        os.environ["TASKPOINT_RUN_NAME"] = args.run_name
    # A tiny model trains fastest on one thread, and a fixed thread count keeps float sums in one order.
    torch.set_num_threads(1)
    result = asyncio.run(train(args.epochs, frozenset(args.fail_at_epoch)))
    print(f"result: {result['epochs']} epochs, final loss {result['loss']:.6f}, finished by attempt "
          f"{result['attempt']}, weights sha256 {result['sha256'][:16]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
