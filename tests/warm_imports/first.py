"""Imported ahead by the save process: it imports :mod:`.second` once that one's import, on another thread, waits
for this one, and reads a name of it at once: a partly initialised :mod:`.second` fails it."""

from __future__ import annotations

from warm_imports import announce, await_, await_blocked

announce("first started")
await_("second started")
await_blocked("warm_imports.first")
import warm_imports.second  # noqa: E402

#: Read by the job, which finds it only where this module is whole.
VALUE = warm_imports.second.BASE + 1
