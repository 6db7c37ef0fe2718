"""A plain PyTorch training loop that saves a ``TrainState`` every step, for tests/e2e/test_resume_exact.py.

CPU, deterministic algorithms, one thread; a small model with dropout, a shuffled ``DataLoader`` over a dataset
whose items draw noise from Python's ``random`` and NumPy's global generator, and label noise from a
``numpy.random.Generator``: every generator ``TrainState`` keeps is used. Three epochs.

One JSON argument: ``directory`` (the manager's), ``keep`` (``"all"``; ``"no-rng"`` saves without the
generators, ``"no-data"`` without the loader's position: the controls), ``background`` (saves in the
background, with the preemption handler's emergency save of the state), and ``pause_after``: the step after
whose save the worker stops itself with a real SIGSTOP (for the test to kill it, or to send SIGTERM and let it
go on). Prints JSON lines: ``resumed`` (the step restored, or None), ``step`` (its number and its loss as
``float.hex``), ``saved``, ``pausing``, and ``done`` with the sha256 of the final parameters' bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import taskpoint
from taskpoint.torch import TrainState

EPOCHS = 3
SAMPLES = 48
BATCH = 6


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed inputs and targets, each item with fresh noise from Python's and NumPy's global generators."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, 8, generator=generator)
        self.y = torch.randn(SAMPLES, 1, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = random.gauss(0.0, 0.1) + float(np.random.normal(0.0, 0.1))
        return self.x[index] + noise, self.y[index]


def main(args: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    labels = np.random.default_rng(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    loader = DataLoader(Noisy(), batch_size=BATCH, shuffle=True)
    keep = args["keep"]
    progress = {"step": 0}
    state = TrainState(model, optimizer, scheduler=scheduler, data=None if keep == "no-data" else loader,
                       rng=False if keep == "no-rng" else [labels], extra=progress)
    background = bool(args.get("background"))
    with taskpoint.CheckpointManager(args["directory"], async_save=background,
                                     on_preemption=(lambda: state) if background else None) as manager:
        say(event="resumed", step=state.restore(manager))
        step = progress["step"]
        for _epoch in range(step // len(loader), EPOCHS):
            for x, y in loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y + float(labels.normal(0.0, 0.05)))
                loss.backward()
                optimizer.step()
                scheduler.step()
                step += 1
                progress["step"] = step
                say(event="step", step=step, loss=loss.item().hex())
                manager.save(state, step)
                say(event="saved", step=step)
                if step == args.get("pause_after"):
                    say(event="pausing", step=step)
                    os.kill(os.getpid(), signal.SIGSTOP)
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode() + tensor.numpy().tobytes())
    say(event="done", step=step, params=digest.hexdigest())


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
