"""The tiny Lightning module and callback the Lightning tests train, imported when a test first needs them.

A module of its own so that collecting the test modules imports neither torch nor Lightning (see
``helpers.LazyModule``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch


class Regressor(L.LightningModule):  # type: ignore[misc]
    """One linear layer fitted to the sum of four inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StartedAt(L.Callback):  # type: ignore[misc]
    """Records the step and weights a fit started from."""

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.step = trainer.global_step
        self.weights = {k: v.clone() for k, v in module.state_dict().items()}
