"""One attempt of a Hugging Face Trainer run for tests/e2e/test_resume_frameworks.py:
``python _hf_same_run.py '<json>'``.

A tiny GPT-2 built from a config (dropout 0.1 in its embeddings, attention and residuals; nothing from the hub),
32 random token sequences shuffled by the Trainer's sampler, 3 epochs of 8 steps, ``full_determinism`` on one
CPU thread; taskpoint's ``CheckpointCallback`` (a step every 5, blocking) and ``resume``, in a fresh
``output_dir`` each attempt (a new machine). It appends JSON lines to ``log``: ``step`` (the step, its loss as
``float.hex``, the sha256 of its batch and of torch's generator state as the step began), ``saved`` once a step
is committed, ``done`` with the sha256 of the final parameters. Options: ``directory`` (the manager's),
``log``, ``leave_out`` (``"generators"``: the restored checkpoint loses its ``rng_state.pth``; ``"position"``:
``ignore_data_skip=True``), the controls.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from taskpoint.transformers import CheckpointCallback, resume

opts: dict[str, Any] = json.loads(sys.argv[1])
SAMPLES, TOKENS, VOCAB, BATCH, EPOCHS, SAVE_EVERY = 32, 8, 64, 4, 3, 5


def log(event: str, **fields: Any) -> None:
    with open(opts["log"], "a") as f:
        f.write(json.dumps({"event": event, **fields}) + "\n")


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


class Recorded(Trainer):
    """The Trainer, logging each step's batch, generator state and loss."""

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        generators = sha256(torch.get_rng_state())
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        log("step", step=self.state.global_step + 1, loss=loss.item().hex(), batch=sha256(inputs["input_ids"]),
            generators=generators)
        return loss


class Committed(TrainerCallback):
    """After the ``CheckpointCallback`` (blocking) committed a step: what the test's SIGKILL waits for."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        log("saved", step=state.global_step)


def main() -> None:
    torch.set_num_threads(1)
    transformers.set_seed(0)
    ids = torch.randint(0, VOCAB, (SAMPLES, TOKENS), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16))
    output_dir = tempfile.mkdtemp(prefix="hf-output-")
    args = TrainingArguments(output_dir=output_dir, num_train_epochs=EPOCHS, save_steps=SAVE_EVERY,
                             per_device_train_batch_size=BATCH, seed=0, full_determinism=True, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, logging_steps=1000,
                             ignore_data_skip=opts.get("leave_out") == "position")
    callback = CheckpointCallback(opts["directory"], blocking=True)
    trainer = Recorded(model=model, args=args, train_dataset=data, callbacks=[callback, Committed()])
    checkpoint = resume(opts["directory"], output_dir)
    if checkpoint is not None and opts.get("leave_out") == "generators":
        Path(checkpoint, "rng_state.pth").unlink()
    trainer.train(resume_from_checkpoint=checkpoint)
    log("done", step=trainer.state.global_step,
        params=sha256(torch.cat([p.detach().flatten() for p in trainer.model.parameters()])))


if __name__ == "__main__":
    main()
