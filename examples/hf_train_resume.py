"""Train a tiny GPT-2 with the Hugging Face Trainer, keep its checkpoints in taskpoint, and resume after a kill.

The glue is three lines: the import, ``CheckpointCallback(directory)`` in ``callbacks=`` and
``resume_from_checkpoint=resume(directory, output_dir)``. Every checkpoint the Trainer writes
(``output_dir/checkpoint-N``, every ``--save-steps`` steps) becomes step N of a deduplicated
``CheckpointManager`` at ``--directory``, uploaded in the background. Run it again after a SIGKILL and it resumes
from the newest committed step; on SIGTERM it saves the step it reached, commits it and exits with status 143.

    python examples/hf_train_resume.py --directory runs/hf            # trains 10 steps from scratch
    python examples/hf_train_resume.py --directory runs/hf --step-delay 1 &  sleep 12; kill -TERM $!
    python examples/hf_train_resume.py --directory runs/hf            # resumes at the step the SIGTERM stopped
    python examples/hf_train_resume.py --directory runs/hf-2 --save-steps 1 --save-total-limit 2 --log-level INFO

The last line saves every step and keeps the two newest (the Trainer's ``save_total_limit``, which the callback
follows): each save after the third deletes a step and sweeps the chunks no step names any more; ``INFO`` shows
one line per save and restore, and what a save waited for.

The model is built from a config and the data is random tokens: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here comes from the hub

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from taskpoint.transformers import CheckpointCallback, resume

SEED = 0
SAMPLES, TOKENS, VOCAB = 32, 8, 64


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A fixed set of random token sequences, learned as a language model."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (SAMPLES, TOKENS), generator=torch.Generator().manual_seed(SEED + 1))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Progress(TrainerCallback):
    """Prints ``step N`` after each optimizer step (flushed), slowed by ``delay`` seconds so a kill can land."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"training from step {state.global_step}", flush=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"step {state.global_step}", flush=True)
        time.sleep(self.delay)


def build_trainer(output_dir: str, *, max_steps: int, save_steps: int, callbacks: list[Any],
                  save_total_limit: int | None = None) -> Trainer:
    torch.set_num_threads(1)  # one thread: CPU kernels give the same bits on every run
    transformers.set_seed(SEED)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16))
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, save_steps=save_steps,
                             save_total_limit=save_total_limit, per_device_train_batch_size=4, seed=SEED,
                             report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                             logging_steps=1000)
    return Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=callbacks)


def weights_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--directory", required=True, help="where the steps go: a local path or any fsspec URL")
    parser.add_argument("--storage-options", type=json.loads, default=None, help="JSON, for the store")
    parser.add_argument("--output-dir", default=None, help="the Trainer's local folder (default: a temp folder)")
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--save-total-limit", type=int, default=None,
                        help="keep the newest N checkpoints (the Trainer's and taskpoint's); default: all")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep after each step")
    parser.add_argument("--out", default=None, help="write the final step and weights' sha256 here (JSON)")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="of the taskpoint logger, printed to stderr")
    opts = parser.parse_args()
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("taskpoint").setLevel(opts.log_level)
    output_dir = opts.output_dir or tempfile.mkdtemp(prefix="hf-output-")

    # --8<-- [start:glue]
    callback = CheckpointCallback(opts.directory, storage_options=opts.storage_options)
    trainer = build_trainer(output_dir, max_steps=opts.max_steps, save_steps=opts.save_steps,
                            callbacks=[callback, Progress(opts.step_delay)], save_total_limit=opts.save_total_limit)
    checkpoint = resume(opts.directory, output_dir, storage_options=opts.storage_options)
    print(f"resuming from {checkpoint}" if checkpoint else "starting from scratch", flush=True)
    trainer.train(resume_from_checkpoint=checkpoint)
    # --8<-- [end:glue]

    result = {"global_step": trainer.state.global_step, "sha256": weights_sha256(trainer.model),
              "resumed_from": checkpoint and Path(checkpoint).name}
    print(f"result: {json.dumps(result)}", flush=True)
    if opts.out:
        Path(opts.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
