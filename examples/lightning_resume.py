"""Resume a PyTorch Lightning run inside a retried task, from the newest checkpoint file of the loaded tree.

The Trainer works in a local folder (``default_root_dir``) where ``ModelCheckpoint`` writes
``lightning_logs/version_N/checkpoints/epoch=E-step=S.ckpt`` and ``last.ckpt`` after every epoch. Right
after those files are written, the whole folder is saved with ``ctx().checkpoint.save_sync(folder)``. The next
attempt (after an exception, or a process killed and started again with the same run name) loads the tree,
asks ``taskpoint.latest_checkpoint`` for the newest ``.ckpt`` in it and passes that to
``trainer.fit(ckpt_path=...)``: Lightning restores the weights, the optimizer and its loops, and continues
with the next epoch in a new ``version_N`` folder.

    python examples/lightning_resume.py                        # one attempt
    python examples/lightning_resume.py --fail-at-epoch 1      # attempt 2 resumes at epoch 2
    TASKPOINT_RUN_NAME=demo python examples/lightning_resume.py --kill-at-epoch 2   # killed after epoch 2
    TASKPOINT_RUN_NAME=demo python examples/lightning_resume.py                     # resumes at epoch 3

Epochs count from 0, as Lightning counts them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import taskpoint

SEED = 0
SAMPLES = 128
FEATURES = 8
HIDDEN = 16
BATCH_SIZE = 32
LEARNING_RATE = 0.05
RETRIES = 3
DEFAULT_EPOCHS = 6


class SimulatedFailure(RuntimeError):
    """Raised on purpose after an epoch's save, to show the next attempt resuming."""


class TinyRegressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LEARNING_RATE)


def synthetic_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x @ torch.randn(FEATURES, 1, generator=generator) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return x, y


# --8<-- [start:callback]
class SaveFolderAfterEpoch(ModelCheckpoint):
    """``ModelCheckpoint`` that saves the whole working folder to taskpoint once its epoch files are written.

    A subclass rather than a separate callback: Lightning runs ``ModelCheckpoint`` callbacks after all the
    others, so a plain callback's ``on_train_epoch_end`` would save the folder before the epoch's files exist.
    """

    def __init__(self, folder: Path, checkpoint: taskpoint.Checkpoint, after_save: Callable[[int], None]) -> None:
        # Every epoch's file is kept (and the folder with all of them is saved each epoch): fine for a tiny
        # model; a large one would keep fewer (save_top_k=1) so that each save stays small.
        super().__init__(save_top_k=-1, save_last=True, every_n_epochs=1)
        self._folder = folder
        self._checkpoint = checkpoint
        self._after_save = after_save

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # Lightning has restored ckpt_path by now: these are the epoch and step this attempt starts from.
        context = taskpoint.ctx()
        attempt = context.attempt if context is not None else "?"
        if trainer.ckpt_path:
            print(f"attempt {attempt}: resumed at epoch {trainer.current_epoch}, global step {trainer.global_step}, "
                  f"from {Path(trainer.ckpt_path).relative_to(self._folder)}", flush=True)
        else:
            print(f"attempt {attempt}: started at epoch 0", flush=True)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)  # writes epoch=E-step=S.ckpt and last.ckpt
        if trainer.is_global_zero:
            began = time.perf_counter()
            self._checkpoint.save_sync(self._folder)
            print(f"epoch {trainer.current_epoch}: global step {trainer.global_step}, saved in "
                  f"{time.perf_counter() - began:.3f} s", flush=True)
            self._after_save(trainer.current_epoch)
# --8<-- [end:callback]


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests mean bit-for-bit equal weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --8<-- [start:fit]
@taskpoint.task(retries=RETRIES)
def fit(epochs: int, fail_at_epochs: frozenset[int] = frozenset(), kill_at_epoch: int | None = None) -> dict[str, Any]:
    """Train for ``epochs`` epochs, resuming from the newest checkpoint an earlier attempt saved."""
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    checkpoint = context.checkpoint
    # The attempt's local workspace: the saved tree is loaded into it and the Trainer goes on writing there.
    folder = checkpoint.path
    loaded = checkpoint.load_sync()
    ckpt_path = taskpoint.latest_checkpoint(loaded) if loaded is not None else None
    print(f"attempt {context.attempt} of run {context.run_name}: "
          + (f"loaded {len(list(loaded.rglob('*.ckpt')))} checkpoint files" if loaded else "nothing to load"),
          flush=True)

    def after_save(epoch: int) -> None:
        if epoch == kill_at_epoch:
            print(f"attempt {context.attempt}: killing the process after saving epoch {epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if epoch in fail_at_epochs:
            print(f"attempt {context.attempt}: failing on purpose after saving epoch {epoch}", flush=True)
            raise SimulatedFailure(f"simulated failure after epoch {epoch}")

    torch.manual_seed(SEED)  # the initial weights; a resumed attempt replaces them with the checkpoint's
    model = TinyRegressor()
    x, y = synthetic_data()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=False)
    trainer = L.Trainer(
        default_root_dir=folder,
        logger=CSVLogger(folder),
        callbacks=[SaveFolderAfterEpoch(folder, checkpoint, after_save)],
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=data, ckpt_path=ckpt_path)

    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y).item()
    return {"epochs": trainer.current_epoch, "global_step": trainer.global_step, "loss": loss,
            "attempt": context.attempt, "sha256": weights_digest(model),
            "weights": {name: p.tolist() for name, p in model.state_dict().items()}}
# --8<-- [end:fit]


def quiet_lightning() -> None:
    """Keep the output to what this example prints: Lightning's banner and its expected warnings go."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Every attempt trains in a new local folder, so the restored ModelCheckpoint always notices a new dirpath;
    # with save_top_k=-1 the best-k bookkeeping it drops is not used.
    warnings.filterwarnings("ignore", message=r".*dirpath has changed.*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="epochs to train (default %(default)s)")
    parser.add_argument("--fail-at-epoch", type=int, action="append", default=[], metavar="E",
                        help="raise after saving epoch E (once; repeat the flag for more failures)")
    parser.add_argument("--kill-at-epoch", type=int, metavar="E",
                        help="SIGKILL this process after saving epoch E; rerun with the same run name to resume")
    parser.add_argument("--root", help="storage root, any fsspec URL (sets TASKPOINT_ROOT)")
    parser.add_argument("--run-name", help="name of the run to start or continue (sets TASKPOINT_RUN_NAME)")
    parser.add_argument("--out", type=Path, help="write the final loss, global step and weights to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The task reads these when it is called, so the flags need no second way to configure it.
    if args.root:
        os.environ["TASKPOINT_ROOT"] = args.root
    if args.run_name:
        os.environ["TASKPOINT_RUN_NAME"] = args.run_name
    quiet_lightning()
    # A tiny model trains fastest on one thread, and a fixed thread count keeps float sums in one order.
    torch.set_num_threads(1)
    result = fit(args.epochs, frozenset(args.fail_at_epoch), args.kill_at_epoch)
    print(f"result: {result['epochs']} epochs, global step {result['global_step']}, final loss "
          f"{result['loss']:.6f}, finished by attempt {result['attempt']}, weights sha256 {result['sha256'][:16]}",
          flush=True)
    if args.out:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
