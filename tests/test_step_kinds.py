"""Step kinds as plug-ins: a manifest naming a kind nobody provides is a clear error naming it (and the previous
good step still restores), and a kind from another distribution, found through its ``taskpoint.step_kinds``
entry point, is committed, listed, restored, verified, described, swept and deleted by a process that never
imported it, with the library and the command line alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from taskpoint import CheckpointCorruptError, CheckpointManager
from taskpoint.format.records import sealed

PLUGIN = Path(__file__).with_name("kinds_plugin")
SRC = Path(__file__).resolve().parents[1] / "src"


def _write_foreign_step(root: Path, step: int, kind: str) -> None:
    """A step committed by a kind this process does not have (a newer taskpoint, or an uninstalled plug-in)."""
    folder = root / f"ckpt-{step}"
    folder.mkdir(parents=True)
    doc = {"format": "taskpoint.step", "version": 4, "step": step, "step_kind": kind, "content": {"x": 1},
           "kind": kind, "codec": "raw", "save_id": "f" * 32, "created": 1.0, "size": 1, "sha256": None,
           "crc32": None, "attempt": None, "metadata": {}}
    (folder / "taskpoint.json").write_bytes(sealed(doc))


def test_a_step_of_an_unknown_kind_is_a_corrupt_error_naming_it_and_the_previous_step_survives(tmp_path):
    with CheckpointManager(tmp_path / "steps", keep=1, preemption=False) as mgr:
        mgr.save(b"good", 1)
        _write_foreign_step(tmp_path / "steps", 2, "hologram")
        for call in (lambda: mgr.restore(2), lambda: mgr.verify(2), lambda: mgr.describe(2), lambda: mgr.metadata(2)):
            with pytest.raises(CheckpointCorruptError, match=r"kind 'hologram', which no installed package provides"):
                call()
        with pytest.warns(UserWarning, match="hologram"):
            restored = mgr.restore(fallback=True)
        assert mgr.restored_step == 1 and restored.read_bytes() == b"good"
        report = mgr.verify()
        assert [(s.step, s.state) for s in report.steps] == [(1, "healthy"), (2, "damaged")]
        assert "hologram" in report.steps[1].detail
        mgr.save(b"next", 3)  # keep=1: retention never guesses what the unreadable step holds
        assert mgr.steps() == [2, 3] and (tmp_path / "steps" / "ckpt-2" / "taskpoint.json").exists()


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    paths = os.pathsep.join([*env.pop("extra", "").split(os.pathsep), str(SRC)]).strip(os.pathsep)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": paths, **env}, check=False)


@pytest.mark.e2e("starts a python process")
def test_a_third_party_kind_found_through_its_entry_point_works_end_to_end(tmp_path):
    url = str(tmp_path / "steps")
    writer = _run(f"""
        from pathlib import Path
        import notes_kind, taskpoint
        with taskpoint.CheckpointManager({url!r}, keep=2, grace_seconds=0, preemption=False) as mgr:
            for step in (1, 2):
                Path(mgr.step_uri(step)).mkdir(parents=True)
                (Path(mgr.step_uri(step)) / "note.txt").write_text("line\\n" * step)
                mgr.commit(step, notes_kind.Note(), metadata={{"step": step}})
            Path(mgr.step_uri(3)).mkdir()
            (Path(mgr.step_uri(3)) / "note.txt").write_text("never committed")
    """, extra=str(PLUGIN))
    assert writer.returncode == 0, writer.stderr
    reader = _run(f"""
        import json, sys, taskpoint
        assert "notes_kind" not in sys.modules
        with taskpoint.CheckpointManager({url!r}, grace_seconds=0, preemption=False) as mgr:
            described = mgr.describe(2)
            verified = mgr.verify(2).steps[0]
            text = mgr.restore(2).read_text()
            removed = mgr.gc()
            mgr.delete(1)
            print(json.dumps(dict(steps=mgr.steps(), kind=described.kind, payload=described.payload,
                                  details=described.details, metadata=mgr.metadata(2), text=text,
                                  verified=[verified.state, verified.size, verified.detail], removed=removed,
                                  loaded="notes_kind" in sys.modules)))
    """, extra=str(PLUGIN))
    assert reader.returncode == 0, reader.stderr
    got = json.loads(reader.stdout)
    assert got["steps"] == [2] and got["kind"] == "notes" and got["payload"] == "note.txt" and got["loaded"]
    assert got["details"] == {"lines": 2} and got["metadata"] == {"step": 2} and got["text"] == "line\nline\n"
    assert got["verified"] == ["healthy", 10, "the note matches its sha256"]
    assert [Path(uri).relative_to(tmp_path).as_posix() for uri in got["removed"]] == ["steps/ckpt-3/note.txt"]
    assert not (tmp_path / "steps" / "ckpt-1").exists()  # delete: the manifest, then what the kind names

    (tmp_path / "steps" / "ckpt-2" / "note.txt").write_text("line\nlinE\n")
    cli = _run(f"""
        from taskpoint.cli import main
        raise SystemExit(main(["verify", {url!r}]))
    """, extra=str(PLUGIN))
    assert cli.returncode == 2 and "step 2: DAMAGED" in cli.stdout, (cli.stdout, cli.stderr)


@pytest.mark.e2e("starts a python process")
def test_without_the_plug_in_installed_its_steps_are_damaged_by_name_and_nothing_is_removed(tmp_path):
    url = str(tmp_path / "steps")
    writer = _run(f"""
        from pathlib import Path
        import notes_kind, taskpoint
        with taskpoint.CheckpointManager({url!r}, preemption=False) as mgr:
            Path(mgr.step_uri(1)).mkdir(parents=True)
            (Path(mgr.step_uri(1)) / "note.txt").write_text("kept")
            mgr.commit(1, notes_kind.Note())
    """, extra=str(PLUGIN))
    assert writer.returncode == 0, writer.stderr
    with CheckpointManager(url, grace_seconds=0, preemption=False) as mgr:
        assert mgr.steps() == [1] and mgr.gc() == []
        with pytest.raises(CheckpointCorruptError, match="'notes'"):
            mgr.restore(1)
    assert (tmp_path / "steps" / "ckpt-1" / "note.txt").read_text() == "kept"


def _save_each_kind(kind: str, root: Path, tmp_path: Path) -> tuple[str, int]:
    """Step 1 of ``kind`` in ``root`` (a folder of 3 files, or with two ranks two byte strings); its data size."""
    import threading

    model = tmp_path / "model"
    model.mkdir()
    for i in range(3):
        (model / f"w{i}.bin").write_bytes(bytes([i]) * (1000 + i))
    if kind == "sharded":
        rank1 = CheckpointManager(root, rank=1, world_size=2, preemption=False)
        saver = threading.Thread(target=rank1.save, args=(b"rank one", 1))
        saver.start()
        with CheckpointManager(root, rank=0, world_size=2, commit_timeout=30, preemption=False) as rank0:
            rank0.save(b"rank zero!", 1, metadata={"loss": 0.5})
        saver.join(30)
        rank1.close()
        return "sharded", len(b"rank one") + len(b"rank zero!")
    with CheckpointManager(root, dedup=kind == "chunked", preemption=False) as mgr:
        mgr.save(model, 1, metadata={"loss": 0.5})
    return kind, 3003 if kind == "chunked" else (root / "ckpt-1" / next(
        p.name for p in (root / "ckpt-1").iterdir() if p.name.startswith("payload-"))).stat().st_size


@pytest.mark.parametrize("kind", ["payload", "chunked", "sharded"])
def test_verify_and_describe_give_typed_results_for_each_kind(kind, tmp_path):
    root = tmp_path / "steps"
    name, size = _save_each_kind(kind, root, tmp_path)
    with CheckpointManager(root, preemption=False) as mgr:
        (result,) = mgr.verify(1).steps
        described = mgr.describe()
        summary = mgr.inventory()
    assert (result.step, result.state, result.kind, result.size, result.healthy) == (1, "healthy", name, size, True)
    assert result.detail == {"payload": "blake3 pieces match its manifest",
                             "sharded": "2 shards, blake3 pieces match its manifest",
                             "chunked": "deduplicated: 3 files in 3 chunks, each matches its sha256"}[kind]
    assert (described.step, described.kind, described.metadata, described.checked) == (1, name, {"loss": 0.5}, True)
    assert described.payload.startswith("payload-") == (kind == "payload")
    assert {"payload": set(), "sharded": {"shards"}, "chunked": {"files", "folders", "links", "chunk_size", "chunks",
                                                                "unique_chunks"}}[kind] == set(described.details)
    assert [(s.step, s.state, s.problem) for s in summary] == [(1, "committed", None)]


def test_verify_reports_a_damaged_step_and_refuses_a_missing_one_while_the_good_step_stays_healthy(tmp_path):
    root = tmp_path / "steps"
    with CheckpointManager(root, preemption=False) as mgr:
        mgr.save(b"good", 1)
        mgr.save(b"soon damaged", 2)
        payload = next((root / "ckpt-2").glob("payload-*"))
        payload.write_bytes(b"soon DAMAGED")
        with pytest.raises(CheckpointCorruptError,
                           match=rf"step 2 in .* is damaged: piece 0 of {payload.name} \(bytes 0-11\)"):
            mgr.verify(2)
        report = mgr.verify()
        assert [(s.step, s.state) for s in report.steps] == [(1, "healthy"), (2, "damaged")]
        assert report.damaged == [2] and report.changed == [] and not report.healthy
        payload.unlink()
        with pytest.raises(CheckpointCorruptError, match=rf"its payload {payload.name} is missing"):
            mgr.verify(2)
        for call in (lambda: mgr.verify(7), lambda: mgr.describe(7)):
            with pytest.raises(FileNotFoundError, match="step 7 does not exist"):
                call()
        assert mgr.restore(1).read_bytes() == b"good"
    with CheckpointManager(tmp_path / "empty", preemption=False) as empty, \
            pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        empty.verify()


def test_a_checkpoint_verifies_and_describes_what_it_saved(tmp_path):
    from taskpoint import Checkpoint

    with Checkpoint(tmp_path / "a" / "checkpoint") as cp:
        with pytest.raises(FileNotFoundError, match="nothing taskpoint saved"):
            cp.verify()
        cp.save_sync(b"state=1")
        checked, described = cp.verify(), cp.describe()
        assert (checked.state, checked.size, checked.digest) == ("healthy", 7, "crc32")
        assert (described.state, described.size, described.kind) == ("saved", 7, "bytes")
        assert [o["current"] for o in described.objects] == [True]
        (tmp_path / "a" / "checkpoint").write_bytes(b"state=2")  # same size: only reading every byte tells
        assert cp.describe().state == "saved"
        with pytest.raises(CheckpointCorruptError, match="match no checksum its record lists"):
            cp.verify()
        (tmp_path / "a" / "checkpoint").write_bytes(b"state=22")
        assert cp.describe().state == "damaged"
    with Checkpoint(tmp_path / "b", tmp_path / "a" / "checkpoint") as nxt, \
            pytest.raises(CheckpointCorruptError):
        nxt.verify(source=True)
