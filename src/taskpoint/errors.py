"""The exceptions taskpoint raises. Every message names the location and says what to do next."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "NewerFormatError",
    "Preempted",
    "RestoreMismatch",
    "RestoreReport",
    "SaveStalledError",
    "StepAbandonedError",
    "StorageAccessDenied",
    "StorageError",
    "StorageFull",
    "StorageNotFound",
    "StorageUnavailable",
    "UnsafeArchiveError",
]


class CheckpointError(Exception):
    """Base class of every error taskpoint raises on purpose."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint exists but its bytes are not what was saved: truncated, bit-flipped, or not an archive."""


class NewerFormatError(CheckpointCorruptError):
    """A stored document is of a format version newer than this taskpoint reads: not damage, upgrade taskpoint to
    read it. A CheckpointCorruptError (as it was before it had a class of its own), so that every ``except
    CheckpointCorruptError`` still catches it; catch this class first to tell the two apart."""


class UnsafeArchiveError(CheckpointCorruptError):
    """An archive member would land outside the workspace (absolute path, ``..``, escaping link, device)."""


class StepAbandonedError(CheckpointError, TimeoutError):
    """Rank 0 of a multi-rank save gave up waiting for the other ranks' shards: the step was not committed
    (it never appears in ``steps()``), and its stored shards are removed by ``gc()`` after the grace period."""


class SaveStalledError(CheckpointError):
    """A save ran past what its lease or the grace period covers (the process was paused, frozen or starved)
    and a sweep took what it had stored for a dead save's leftovers: the save committed nothing (or took back
    its commit), the previous steps are intact, and saving again works."""


class StorageError(CheckpointError):
    """Storage could not do what was asked. The subclasses say why; anything else (a parent path that is a
    file, a name the store refuses) is a plain StorageError. Never raised for "there is no checkpoint"."""


class StorageUnavailable(StorageError):
    """Storage kept failing transiently (network, timeouts, throttling, 5xx) after the retries ran out."""


class StorageAccessDenied(StorageError):
    """Credentials are missing or were rejected, or permissions forbid the operation. Not retried; the
    message names the credential source that was tried, never a credential's value."""


class StorageNotFound(StorageError):
    """The bucket or container (or, for a save, a folder the store will not create) does not exist."""


class StorageFull(StorageError):
    """No space left: on the destination, or on the local disk a load extracts to. Not retried."""


#: How many names of each kind a :class:`RestoreMismatch` message lists before "and N more".
NAMES_SHOWN = 5


@dataclass(frozen=True)
class RestoreReport:
    """What a restore into a target (a model, a :class:`~taskpoint.torch.TrainState`, a PyTree target) did not
    restore, returned by the restore with ``strict=False``; empty lists mean everything matched.

    Attributes:
        step: the step restored (None for a :class:`~taskpoint.Checkpoint`'s previous checkpoint).
        missing: names the target has and the checkpoint does not: left as they were in the target.
        unexpected: names the checkpoint has and the target does not: not restored.
        mismatched: ``(name, what differs)`` for names in both whose shape or dtype differ: left as they were.
    """

    step: int | None
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, str], ...] = ()

    @property
    def complete(self) -> bool:
        """True when everything in the checkpoint and the target matched, and all of it was restored."""
        return not (self.missing or self.unexpected or self.mismatched)

    def problems(self) -> list[str]:
        """One line per name that did not match, mismatched first: ``"fc.weight: shape (4, 3) in the checkpoint
        vs (5, 3) in the target"``."""
        return [*(f"{name}: {what}" for name, what in self.mismatched),
                *(f"{name}: the target has this, the checkpoint does not" for name in self.missing),
                *(f"{name}: the checkpoint has this, the target does not" for name in self.unexpected)]


class RestoreMismatch(CheckpointError, ValueError):
    """A checkpoint does not match the target it is restored into (names missing, unexpected, or of another
    shape or dtype), and the restore was strict: nothing was restored. The message names the first few of each
    and how many there are; :attr:`report` lists them all. ``strict=False`` restores what matches instead and
    returns that report. A ValueError too, as a mismatched target was before this class existed."""

    def __init__(self, report: RestoreReport, where: str) -> None:
        problems = report.problems()
        shown = "; ".join(problems[:NAMES_SHOWN])
        more = f"; and {len(problems) - NAMES_SHOWN} more" if len(problems) > NAMES_SHOWN else ""
        counts = ", ".join(f"{count} {what}" for count, what in (
            (len(report.mismatched), "of another shape or dtype"), (len(report.missing), "missing from the checkpoint"),
            (len(report.unexpected), "not in the target")) if count)
        super().__init__(f"{shown}{more} ({where} does not match the target's structure: {counts}; nothing was "
                         "restored. Restore with strict=False to load what matches and get a report of the rest, "
                         "or restore without a target to see what it holds)")
        self.report = report


class Preempted(SystemExit):
    """The attempt ended at a safe point after a preemption notice, once its emergency save committed.

    A :class:`SystemExit` (not an :class:`Exception`), so that ``except Exception`` in a training loop does not
    swallow it, and so that, uncaught, it ends the process quietly with exit status ``128 + signal`` (143 for
    SIGTERM, 138 for SIGUSR1), the status a process killed by that signal reports to shells and runners.
    ``@task`` never retries it in the process (the process is about to be stopped) and never counts it as a
    failure; the next attempt (the restarted process) resumes from :attr:`step`.

    Attributes:
        signal: the signal of the notice.
        step: the emergency step the manager committed, or None when the task's checkpoint was saved.
        uri: where the emergency save landed (None when nothing was saved).
        committed_at: ``time.time()`` when the emergency save had committed (None when nothing was saved).
    """

    def __init__(self, signal: int, step: int | None = None, uri: str | None = None,
                 committed_at: float | None = None) -> None:
        super().__init__(128 + int(signal))
        self.signal = int(signal)
        self.step = step
        self.uri = uri
        self.committed_at = committed_at

    def __str__(self) -> str:
        where = f" as step {self.step}" if self.step is not None else ""
        saved = f"; the emergency save committed{where} at {self.uri}" if self.uri else ""
        return f"preempted by signal {self.signal}{saved}"


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where the note is kept in ``__notes__`` for tools to show)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


def say_in_message(error: BaseException, what: str) -> None:
    """Put ``what`` in the message of one of taskpoint's errors, for Python 3.10, which does not print notes, and
    for logs that keep only the message: which background save, which rank the error comes from. Other
    exceptions are left as they are (their arguments may mean something else)."""
    if isinstance(error, CheckpointError) and len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} [{what}]",)
