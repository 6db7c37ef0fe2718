"""The save process imports modules ahead (``WARM``) on a thread of its own, and serves a request only between two of
those imports: a request whose job imports, beside them, modules that import each other (as torch and numpy do)
would otherwise meet Python's import-deadlock detection, which hands one thread a partly initialised module."""

from __future__ import annotations

from taskpoint.manager.saver import SaverProcess
from taskpoint.manager.staging import Segment
from taskpoint.storage import Location


def test_a_request_sent_while_the_save_process_imports_ahead_is_served_after_those_imports(tmp_path, monkeypatch):
    import warm_imports.first  # noqa: F401  (imported here with no markers: at once, first first)
    from warm_imports.second import Job

    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("TASKPOINT_TEST_WARM_MARKERS", str(markers))  # the save process's modules wait to meet
    process = SaverProcess()
    segment = Segment.create(4096, process.owner)
    try:
        process.warm(["warm_imports.first"])
        sizes, manifest = process.store_staged(Location(str(tmp_path / "step" / "taskpoint.json")), str(segment.path),
                                               Job())
        process.done()
    finally:
        process.close()
        segment.free()
    assert sizes == {"first": 2} and manifest is None
    assert (markers / "first started").exists()  # the import ahead ran, and the job found its module whole
