"""Training step time of a small Lightning model saving a ``.ckpt`` every N steps: no checkpoints, Lightning's own
saving (``TorchCheckpointIO``, fsspec for ``s3://``), taskpoint's plug-in, and both inside Lightning's
``AsyncCheckpointIO``; on local disk and on moto's S3 server in its own process. Prints the mean step time and
its ratio to the run without checkpoints. Run: ``python -m benchmarks.lightning_step_time [--params N]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

import taskpoint.lightning

REPO_ROOT = Path(__file__).resolve().parent.parent


class Net(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, width)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class StepClock(Callback):
    """Wall time from each batch start to the next one (what the training loop waits, saves included)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def run(root: str, plugin: Any, width: int, steps: int, every: int) -> float:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(steps * 8, width)), batch_size=8)
    clock = StepClock()
    callbacks: list[Any] = [clock]
    if plugin is not None:
        callbacks.append(ModelCheckpoint(every_n_train_steps=every, save_top_k=2, monitor="step", mode="max",
                                         save_last=True))
    trainer = L.Trainer(default_root_dir=root, max_steps=steps, logger=False, accelerator="cpu", devices=1,
                        plugins=[plugin] if plugin is not None else None, callbacks=callbacks,
                        enable_checkpointing=plugin is not None, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Net(width), train_dataloaders=data)
    if isinstance(plugin, AsyncCheckpointIO):
        plugin.teardown()
    return sum(clock.times[1:]) / len(clock.times[1:])  # the first step pays warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="Linear(width, width): 1024 is a 4 MiB .ckpt")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=2, help="every_n_train_steps")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    server = subprocess.Popen([sys.executable, "-m", "benchmarks._s3server"], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        info = json.loads(server.stdout.readline())
        options = info["storage_options"]
        # Lightning's own fsspec instances take no storage options: give them the endpoint and keys this way.
        os.environ.update(AWS_ENDPOINT_URL=info["endpoint"], AWS_ACCESS_KEY_ID=options["key"],
                          AWS_SECRET_ACCESS_KEY=options["secret"])
        with tempfile.TemporaryDirectory() as work:
            roots = {"local": f"{work}/local", "s3": f"s3://{info['bucket']}/bench-lightning"}
            cases = {
                "no checkpoints": lambda o: None,
                "Lightning TorchCheckpointIO": lambda o: TorchCheckpointIO(),
                "taskpoint CheckpointIO": lambda o: taskpoint.lightning.CheckpointIO(storage_options=o),
                "AsyncCheckpointIO(Torch)": lambda o: AsyncCheckpointIO(TorchCheckpointIO()),
                "AsyncCheckpointIO(taskpoint)": lambda o: AsyncCheckpointIO(taskpoint.lightning.CheckpointIO(o)),
            }
            print(f"Linear({args.width}, {args.width}): {4 * args.width * (args.width + 1) / 2**20:.1f} MiB of "
                  f"weights; a .ckpt every {args.every} steps; {args.steps} steps; mean step time in ms, its ratio to "
                  "no checkpoints (x none) and to Lightning's own saving on the same store (x Lightning), one run")
            steps: dict[str, dict[str, float]] = {}
            for i, (name, make) in enumerate(cases.items()):
                steps[name] = {store: run(f"{root}/{i}", make(options if store == "s3" else {}), args.width,
                                          args.steps, args.every) for store, root in roots.items()}
            none, own = steps["no checkpoints"], steps["Lightning TorchCheckpointIO"]
            print(f"| {'case':30} | {'local ms':>8} | {'x none':>6} | {'x Lightning':>11} | {'s3 ms':>7} | "
                  f"{'x none':>6} | {'x Lightning':>11} |")
            print(f"|{'-' * 32}|{'-' * 10}|{'-' * 8}|{'-' * 13}|{'-' * 9}|{'-' * 8}|{'-' * 13}|")
            for name, by_store in steps.items():
                cells = [f"{by_store[s] * 1000:>{8 if s == 'local' else 7}.1f} | {by_store[s] / none[s]:>6.2f} | "
                         f"{by_store[s] / own[s]:>11.2f}" for s in roots]
                print(f"| {name:30} | {cells[0]} | {cells[1]} |", flush=True)
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
