"""Lightning writing its checkpoints through taskpoint, surviving SIGKILL and SIGTERM.

Four lines of glue: the ``CheckpointIO`` plug-in (every ``.ckpt`` atomic, recorded, verified on load), the
``SaveOnPreemption`` callback (SIGTERM: a checkpoint at the next batch end, then exit status 143), the
``ResumeExactly`` callback (a mid-epoch resume draws the batch and the random numbers the interrupted run would
have drawn), and ``ckpt_path="last"`` (resume from the newest ``last.ckpt``, on any store):

    python examples/lightning_plugin.py --root ./run --steps 40             # trains; rerun: nothing left to do
    python examples/lightning_plugin.py --root ./run2 --steps 400 &         # kill -TERM it: exit 143
    python examples/lightning_plugin.py --root ./run2 --steps 400           # resumes at the signalled step
    python examples/lightning_plugin.py --root s3://bucket/run --steps 40   # storage options: TASKPOINT_STORAGE_OPTIONS

Prints ``step N`` after each training step, and with ``--out`` writes what the run started from and ended with.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import taskpoint.lightning

SEED = 0


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Report(Callback):
    """Prints each step; records the step and weights the fit started from and the last step it finished."""

    def __init__(self, out: Path | None, sleep: float) -> None:
        self.out, self.sleep, self.result = out, sleep, {}

    def _weights(self, module: L.LightningModule) -> dict[str, list[float]]:
        return {k: v.flatten().tolist() for k, v in module.state_dict().items()}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.result.update(ckpt_path=trainer.ckpt_path, start_step=trainer.global_step,
                           start_weights=self._weights(module))
        self._write()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.result.update(end_step=trainer.global_step, end_weights=self._weights(module))
        self._write()
        print(f"step {trainer.global_step}", flush=True)
        time.sleep(self.sleep)

    def _write(self) -> None:
        if self.out is not None:  # whole or not at all, whenever the process is killed
            self.out.with_suffix(".tmp").write_text(json.dumps(self.result))
            self.out.with_suffix(".tmp").replace(self.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="default_root_dir: a local folder or a URL (s3://...)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of pretend work after each step")
    parser.add_argument("--async-save", action="store_true", help="wrap the plug-in in Lightning's AsyncCheckpointIO")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    x = torch.randn(256, 16)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
    options = json.loads(os.environ.get("TASKPOINT_STORAGE_OPTIONS", "{}"))

    # --8<-- [start:glue]
    io = taskpoint.lightning.CheckpointIO(storage_options=options)
    trainer = L.Trainer(
        default_root_dir=args.root, max_steps=args.steps, logger=False, accelerator="cpu", devices=1,
        plugins=[L.pytorch.plugins.io.AsyncCheckpointIO(io) if args.async_save else io],
        callbacks=[Report(args.out, args.sleep), taskpoint.lightning.SaveOnPreemption(),
                   taskpoint.lightning.ResumeExactly(),  # the generators and the place in the epoch
                   ModelCheckpoint(every_n_train_steps=5, save_top_k=2, monitor="step", mode="max", save_last=True)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Regressor(), train_dataloaders=data, ckpt_path="last")
    # --8<-- [end:glue]


if __name__ == "__main__":
    main()
