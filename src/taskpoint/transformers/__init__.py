"""taskpoint's Hugging Face transformers extra: a ``TrainerCallback`` that stores every checkpoint the Trainer
writes as a verified step of a :class:`~taskpoint.CheckpointManager`, and ``resume`` to bring the newest back.

Install it with ``pip install "taskpoint[transformers]"``::

    from taskpoint.transformers import CheckpointCallback, resume

    trainer = Trainer(model, args, train_dataset=data, callbacks=[CheckpointCallback("s3://bucket/run-7/hf")])
    trainer.train(resume_from_checkpoint=resume("s3://bucket/run-7/hf", args.output_dir))

Steps are deduplicated by default (consecutive checkpoints share the tokenizer, the config and any frozen
weights) and uploaded in the background. On SIGTERM the callback asks the Trainer to save and stop, commits
that checkpoint and ends the process with status 143. See docs/guides/transformers.md.
"""

try:
    import transformers  # noqa: F401
except ImportError as exc:
    raise ImportError(f'taskpoint.transformers needs Hugging Face transformers ({exc}); install it with '
                      f'pip install "taskpoint[transformers]"') from exc

from ._callback import CheckpointCallback
from ._resume import resume

__all__ = ["CheckpointCallback", "resume"]
