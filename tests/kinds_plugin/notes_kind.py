"""A third-party step kind for tests/test_step_kinds.py: a step that is one text file, ``note.txt``, stored by
its own writer in the step's folder and committed through ``CheckpointManager.commit``. Found by readers
through the ``taskpoint.step_kinds`` entry point of the ``notes-kind`` distribution beside it."""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from taskpoint.errors import CheckpointCorruptError
from taskpoint.manager.kind_api import (
    Checked,
    Described,
    Gone,
    ObjectRecord,
    StepObjects,
    Stored,
    register_step_kind,
    stored_names,
    stored_part,
)

NOTE = "note.txt"


@dataclass(frozen=True)
class Note:
    kind: ClassVar[str] = "notes"
    name: str = NOTE

    def to_json(self) -> dict[str, Any]:
        return {"file": self.name}


class NotesKind:
    name = "notes"
    helper = False

    def decode(self, body):
        if body["file"] != NOTE:
            raise ValueError("a note is named note.txt")
        return Note(body["file"])

    def accepts(self, payload, context):
        return False

    def store(self, context, job):
        data = context.steps.object(job.step, NOTE).read_small()
        if data is None:
            raise FileNotFoundError("store note.txt before the commit")
        record = ObjectRecord(kind="notes", codec="raw", save_id=uuid.uuid4().hex, created=time.time(),
                              size=len(data), sha256=hashlib.sha256(data).hexdigest())
        return Stored(job.payload, record, {NOTE: len(data)}, sent=len(data))

    def restore(self, context, step, manifest, workspace, progress):
        data = context.steps.object(step, NOTE).read_small()
        if data is None:
            raise Gone(f"step {step} is committed but {NOTE} is missing")
        if hashlib.sha256(data).hexdigest() != manifest.record.sha256:
            raise CheckpointCorruptError(f"step {step} in {context.steps.directory}: {NOTE} is damaged")
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / NOTE).write_bytes(data)
        return Path(workspace / NOTE)

    def verify(self, context, step, manifest, progress):
        size = stored_part(context, step, NOTE, manifest.record.size, manifest.record.sha256, progress, "verify")
        return Checked(size, "the note matches its sha256")

    def objects(self, steps, step, manifest):
        return StepObjects(files={NOTE: manifest.record.size}, noun="note")

    def delete(self, steps, step, manifest):
        steps.object(step, NOTE).remove()
        return {NOTE}

    def describe(self, context, step, manifest):
        return Described(payload=NOTE, details={"lines": len((context.steps.object(step, NOTE).read_small() or b"")
                                                             .splitlines())})

    def owns(self, name, committed):
        return bool(_OWNED.fullmatch(name))


_OWNED = stored_names(r"note\.txt")
NOTES = register_step_kind(NotesKind())
