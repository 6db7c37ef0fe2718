"""taskpoint's Lightning extra: every ``.ckpt`` a ``Trainer`` writes becomes a verified taskpoint checkpoint.

Install it with ``pip install "taskpoint[lightning]"``::

    import taskpoint.lightning

    trainer = lightning.Trainer(default_root_dir="s3://bucket/run",
                                plugins=[taskpoint.lightning.CheckpointIO()],
                                callbacks=[taskpoint.lightning.SaveOnPreemption(),
                                           taskpoint.lightning.ResumeExactly()])
    trainer.fit(model, ckpt_path="last")

:class:`CheckpointIO` saves each ``.ckpt`` atomically with its record beside it (``<ckpt>.taskpoint.json``),
retried, and verifies every byte before ``torch.load``; ``ckpt_path="last"`` resolves on every store with the
plug-in's storage options (Lightning 2.6 alone cannot on ``s3://``; ``_last.py`` says how).
:class:`SaveOnPreemption` turns SIGTERM (or a spot notice) into a checkpoint at the next batch end and exit
status 143. :class:`ResumeExactly` keeps the random generators and the place in the epoch in every checkpoint, so
that a fit resumed mid-epoch draws the batch and the random numbers the interrupted fit would have drawn. See
docs/guides/lightning.md and docs/resume-frameworks.md.
"""

try:
    import lightning.pytorch  # noqa: F401
except ImportError as exc:
    raise ImportError(f'taskpoint.lightning needs Lightning >= 2.4 ({exc}); install it with '
                      f'pip install "taskpoint[lightning]"') from exc

from ._io import CheckpointIO
from ._preemption import SaveOnPreemption
from ._resume import ResumeExactly

__all__ = ["CheckpointIO", "ResumeExactly", "SaveOnPreemption"]
