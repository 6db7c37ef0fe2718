"""A damaged manifest is never believed (issue 21 item 3): every step manifest and rank record carries a check of its
own content, and one that fails it is CheckpointCorruptError for restore (or a fallback), metadata, ls, verify, and
gc, which then removes nothing it might name. Manifests written before the check still read, marked unchecked.
Real stores: local disk, and the S3 server for gc."""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from _servers import StoreLocation
from helpers import object_exists, read_object, snapshot, write_object
from reliability import QUICK_COUNTS, manifests
from reliability._common import Servers, list_objects, table
from taskpoint import CheckpointCorruptError, CheckpointManager, NewerFormatError, StepAbandonedError
from taskpoint.cli import main
from taskpoint.format.records import PIECES_VERSION

pytestmark = pytest.mark.timeout(600)
MANIFEST = "taskpoint.json"


def tp(capsys: Any, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _local(tmp_path: Path) -> StoreLocation:
    base = tmp_path / "store"
    base.mkdir()
    return StoreLocation("local", str(base), {})


def manager(place: Any, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(place.url("steps"), storage_options=place.storage_options, preemption=False, **kwargs)


def saved_steps(place: Any, tmp_path: Path, **kwargs: Any) -> dict[int, Any]:
    """Steps 1 and 2 of two versions of a small folder (run.sh 0o755, data, metadata); their snapshots."""
    expected = {}
    with manager(place, **kwargs) as mgr:
        for step in (1, 2):
            folder = manifests.write_folder(tmp_path / f"v{step}", step)
            mgr.save(folder, step, metadata=manifests.METADATA)
            expected[step] = snapshot(folder)
    return expected


def manifest_url(place: Any, step: int) -> str:
    return place.url("steps", f"ckpt-{step}", MANIFEST)


def edit_manifest(place: Any, step: int, old: str, new: str) -> None:
    """Replace ``old`` (once, as the stored text has it) with ``new`` in ``step``'s manifest, the check untouched."""
    text = read_object(manifest_url(place, step), place.storage_options).decode()
    assert text.count(old) >= 1, text
    write_object(manifest_url(place, step), place.storage_options, text.replace(old, new, 1).encode())


# -- the campaign: random bits and bytes of every kind of manifest and record --------------------------------


@pytest.mark.parametrize("trials", [
    QUICK_COUNTS["manifest_damage"]["local"],
    pytest.param(1000, id="1000", marks=pytest.mark.campaign("1000 damaged manifests (make test: 100)")),
], ids=lambda n: str(n))
def test_a_damaged_byte_of_any_manifest_or_record_is_never_silently_wrong(tmp_path: Path, trials: int) -> None:
    """One bit flipped or one byte replaced at random in step manifests (plain, deduplicated, two ranks), a rank's
    record, a checkpoint's record and a file-set manifest: each trial raises, falls back or reads what was saved,
    and gc removes nothing the manifests name; 0 silently wrong."""
    with Servers() as servers:
        [result] = manifests.run(servers, {"local": trials}, random.Random(20261202 + trials), tmp_path)
    print("\n" + table([result]))
    assert result.failures == 0, "\n".join([table([result]), *result.errors])
    assert result.trials == trials and set(result.figures) == set(manifests.KINDS)
    # Not a vacuous pass: every kind had its damage detected (a bit of a name or digest cannot read as equal).
    assert all(tally["raised"] > 0 for tally in result.figures.values()), result.figures


# -- what a damaged manifest does ----------------------------------------------------------------------------

#: The silently wrong results of the issue's finding, each now a manifest that fails its check.
ISSUE_FINDINGS = {
    "metadata value": ('"lr": 0.001', '"lr": 0.011'),
    "metadata key": ('"epoch"', '"epokh"'),
    "file name": ('"run.sh"', '"run.s("'),
    "file mode": ('"mode": 493', '"mode": 420'),
}


#: A payload step's manifest names no file (its archive does, and the archive's sha256 vouches for it).
CASES = [("dedup", finding) for finding in sorted(ISSUE_FINDINGS)] + [("plain", "metadata key"),
                                                                      ("plain", "metadata value")]


@pytest.mark.parametrize(("kind", "finding"), CASES)
def test_the_issues_silent_changes_are_damage_everywhere_the_manifest_is_read(
        capsys: Any, tmp_path: Path, kind: str, finding: str) -> None:
    place = _local(tmp_path)
    expected = saved_steps(place, tmp_path, dedup=kind == "dedup")
    edit_manifest(place, 2, *ISSUE_FINDINGS[finding])
    with manager(place) as mgr:
        with pytest.raises(CheckpointCorruptError, match=r"step 2 .*fails its check"):
            mgr.restore(2)
        with pytest.raises(CheckpointCorruptError, match="step 2"):
            mgr.metadata(2)
        with pytest.warns(UserWarning, match="step 2"):
            assert snapshot(mgr.restore(fallback=True)) == expected[1] and mgr.restored_step == 1
        assert mgr.steps() == [1, 2] and mgr.latest_step() == 2  # listed as before: it has a manifest
    code, out, _ = tp(capsys, "ls", place.url("steps"), "--json")
    rows = {row["step"]: row for row in json.loads(out)["steps"]}
    assert code == 0 and rows[1]["state"] == "committed" and rows[2]["state"] == "damaged"
    assert "fails its check" in rows[2]["problem"]
    code, out, _ = tp(capsys, "verify", place.url("steps"))
    assert code == 2 and "step 2: DAMAGED" in out and "step 1: healthy" in out
    code, _, err = tp(capsys, "show", place.url("steps"), "--step", "2")
    assert code == 2 and "fails its check" in err


@pytest.fixture(params=["local", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A fresh place on local disk or on the S3 server."""
    if request.param == "local":
        return _local(tmp_path)
    return request.getfixturevalue("s3_server").new_location()


def test_gc_keeps_every_chunk_a_damaged_manifest_might_name(place: Any, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The issue's finding: gc --grace 0 read a manifest with a flipped chunk key as valid and removed the real chunk
    (6 -> 4 chunks). Now it removes no chunk at all until the manifest is repaired or the step removed."""
    expected = saved_steps(place, tmp_path, dedup=True)
    with manager(place, dedup=True) as mgr:
        mgr.save(manifests.write_folder(tmp_path / "v0", 0), 0)
        mgr.delete(0, force=True)  # its own chunks stay, named by no manifest, until a gc
    chunks = [o for o in list_objects(place, "steps") if o.startswith("chunks/")]
    pristine = read_object(manifest_url(place, 2), place.storage_options)
    key = re.findall(r'"([0-9a-f]{64})\.zst"', pristine.decode())[0]
    edit_manifest(place, 2, key, key[:10] + ("0" if key[10] != "0" else "1") + key[11:])  # one digit of a chunk key
    with manager(place, dedup=True) as mgr:
        assert mgr.gc(grace_seconds=0) == []
        assert [o for o in list_objects(place, "steps") if o.startswith("chunks/")] == chunks
        assert "the manifest of step 2 in" in caplog.text and "no chunk is removed until" in caplog.text
        write_object(manifest_url(place, 2), place.storage_options, pristine)  # repaired: step 0's chunks go
        removed = mgr.gc(grace_seconds=0)
        assert removed and all("chunks/" in uri for uri in removed)
        assert snapshot(mgr.restore(2)) == expected[2] and snapshot(mgr.restore(1)) == expected[1]


def test_gc_keeps_the_payload_a_damaged_manifest_names(place: Any, tmp_path: Path) -> None:
    """A step folder with a leftover beside its payload is swept by reading its manifest: a damaged one (a payload
    name with a flipped digit) leaves the folder untouched; once repaired, only the leftover goes."""
    expected = saved_steps(place, tmp_path)
    leftover = place.url("steps", "ckpt-2", f"payload-{'0' * 32}")
    write_object(leftover, place.storage_options, b"a superseded save's payload")
    pristine = read_object(manifest_url(place, 2), place.storage_options)
    name = re.findall(r'"payload": "payload-([0-9a-f]{32})"', pristine.decode())[0]
    edit_manifest(place, 2, name, name[:5] + ("0" if name[5] != "0" else "1") + name[6:])
    with manager(place) as mgr:
        assert mgr.gc(grace_seconds=0) == []
        assert object_exists(place.url("steps", "ckpt-2", f"payload-{name}"), place.storage_options)
        assert object_exists(leftover, place.storage_options)
        write_object(manifest_url(place, 2), place.storage_options, pristine)
        assert [uri.rsplit("/", 1)[1] for uri in mgr.gc(grace_seconds=0)] == [f"payload-{'0' * 32}"]
        assert snapshot(mgr.restore(2)) == expected[2]


def test_a_damaged_rank_record_is_never_committed(tmp_path: Path) -> None:
    """Rank 1's record of its shard with its BLAKE3 piece reversed: rank 0 does not commit a step naming it;
    the step is abandoned after the commit timeout, and the previous step stays the newest."""
    place = _local(tmp_path)
    options = {"world_size": 2, "grace_seconds": 5.0, "commit_timeout": 0.5}
    with manager(place, rank=1, **options) as rank1:
        rank1.save(b"rank 1's shard", 1)
    record = place.url("steps", "ckpt-1", "rank-1.json")
    text = read_object(record, place.storage_options).decode()
    digest = json.loads(text)["shard"]["pieces"][0]
    write_object(record, place.storage_options, text.replace(digest, digest[::-1]).encode())
    with manager(place, rank=0, **options) as rank0:
        with pytest.raises(StepAbandonedError, match="ranks \\[1\\]"):
            rank0.save(b"rank 0's shard", 1)
        assert rank0.steps() == []


# -- manifests written before the check ----------------------------------------------------------------------


def without_check(place: Any, step: int) -> None:
    """Rewrite ``step``'s manifest as a taskpoint before manifest checks wrote it: the same JSON, no check; a payload
    step (version 7 now) in the layout of then, version 1, its payload recorded by sha256."""
    doc = json.loads(read_object(manifest_url(place, step), place.storage_options))
    del doc["check"]
    if doc["version"] == PIECES_VERSION:
        content = doc.pop("content")
        payload = read_object(place.url("steps", f"ckpt-{step}", content["payload"]), place.storage_options)
        del doc["step_kind"], doc["piece_size"], doc["piece_hash"], doc["pieces"]
        doc.update(content, version=1, sha256=hashlib.sha256(payload).hexdigest())
    write_object(manifest_url(place, step), place.storage_options,
                 json.dumps(doc, sort_keys=True, allow_nan=False).encode())


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_a_manifest_from_before_checks_still_restores_and_reads_as_unchecked(
        capsys: Any, tmp_path: Path, dedup: bool) -> None:
    place = _local(tmp_path)
    expected = saved_steps(place, tmp_path, dedup=dedup)
    without_check(place, 2)
    with manager(place, dedup=dedup) as mgr:
        assert snapshot(mgr.restore(2)) == expected[2] and mgr.metadata(2) == manifests.METADATA
        mgr.save(manifests.write_folder(tmp_path / "v3", 3), 3)  # saving beside it sweeps nothing of it
        assert mgr.gc(grace_seconds=0) == [] and snapshot(mgr.restore(2)) == expected[2]
    code, out, _ = tp(capsys, "show", place.url("steps"), "--step", "2", "--json")
    assert code == 0 and json.loads(out)["checked"] is False
    code, out, _ = tp(capsys, "show", place.url("steps"), "--step", "1")
    assert code == 0 and "checked: True" in out
    code, out, _ = tp(capsys, "ls", place.url("steps"), "--json")
    assert [row["checked"] for row in json.loads(out)["steps"]] == [True, False, True]
    code, out, _ = tp(capsys, "ls", place.url("steps"))
    assert code == 0 and re.search(r"\n +2  committed\* ", out) and "* manifest unchecked" in out
    code, out, _ = tp(capsys, "verify", place.url("steps"), "--step", "2")
    assert code == 0 and "step 2: healthy" in out and "manifest unchecked" in out


def test_a_manifest_whose_check_lost_its_name_is_damage_not_an_unchecked_one(tmp_path: Path) -> None:
    """A bit flipped in the name ``check`` leaves a manifest without its check and with a field no older taskpoint
    writes: damage, not a manifest from before checks (which would then be believed unchecked). A deduplicated
    step keeps the layout of a version written before checks; a payload step's version (6) never had a form
    without its check."""
    place = _local(tmp_path)
    saved_steps(place, tmp_path, dedup=True)
    edit_manifest(place, 2, '"check"', '"check"'.replace("e", "a", 1))
    with manager(place, dedup=True) as mgr, pytest.raises(CheckpointCorruptError, match="no check and fields"):
        mgr.metadata(2)
    (tmp_path / "plain").mkdir()
    plain = _local(tmp_path / "plain")
    saved_steps(plain, tmp_path / "plain")
    edit_manifest(plain, 2, '"check"', '"check"'.replace("e", "a", 1))
    with manager(plain) as mgr, pytest.raises(CheckpointCorruptError, match="carries no check"):
        mgr.metadata(2)


def test_a_checked_manifest_may_carry_fields_of_a_newer_taskpoint(tmp_path: Path) -> None:
    """Forward compatibility: a field this taskpoint does not know, in a manifest whose check covers it, is read
    (ignored), as older taskpoints read today's manifests."""
    from taskpoint.format.records import sealed

    place = _local(tmp_path)
    expected = saved_steps(place, tmp_path)
    doc = json.loads(read_object(manifest_url(place, 2), place.storage_options))
    del doc["check"]
    write_object(manifest_url(place, 2), place.storage_options, sealed({**doc, "a_later_field": [1, 2]}))
    with manager(place) as mgr:
        assert snapshot(mgr.restore(2)) == expected[2]


def test_damage_to_the_version_says_upgrade_or_damaged(tmp_path: Path) -> None:
    place = _local(tmp_path)
    saved_steps(place, tmp_path)
    edit_manifest(place, 2, f'"version": {PIECES_VERSION}', '"version": 9')
    with manager(place) as mgr, pytest.raises(NewerFormatError, match=r"upgrade taskpoint.*or it is damaged"):
        mgr.restore(2)
