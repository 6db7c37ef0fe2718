"""The module of the staged job a request sends: it imports :mod:`.first` once that one's import is under way on
another thread."""

from __future__ import annotations

from warm_imports import announce, await_

announce("second started")
await_("first started")
import warm_imports.first  # noqa: E402

#: Read by :mod:`.first` as it is imported.
BASE = 1


class Job:
    """A staged save's job that writes nothing: its sizes carry :data:`.first.VALUE`, there only where
    :mod:`.first` is whole in the process that runs it."""

    def run(self, segment: object, progress: object) -> tuple[dict[str, int], None]:
        return {"first": warm_imports.first.VALUE}, None
