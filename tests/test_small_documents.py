"""The small documents (leases, the chunk epoch, group records, the attempt marker) carry a ``format`` and a
``version`` (issue 42 item 1, docs/format.md): written with the pair, read with or without it (a document an older
taskpoint wrote), and one of a newer version treated as its reader treats one it cannot read, never taken as what
it says. Each is written here by the code that writes it in a run, and held to the specification's tables
(taskpoint.format.conformance)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from taskpoint.errors import NewerFormatError
from taskpoint.format.conformance import format_problems
from taskpoint.format.documents import (
    ATTEMPT_FORMAT,
    EPOCH_FORMAT,
    GROUP_FORMAT,
    LEASE_FORMAT,
    VERSIONS,
    read_small_document,
)
from taskpoint.group import Record, StorageGroup
from taskpoint.manager.chunks import new_epoch
from taskpoint.manager.leases import lease_body, recorded_beat, recorded_grace
from taskpoint.ranks import Ranks
from taskpoint.runtime.lineage import ActionStore
from taskpoint.storage import Location


def _newer(data: bytes) -> bytes:
    doc = json.loads(data)
    return json.dumps({**doc, "version": doc["version"] + 1}).encode()


def _older(data: bytes) -> bytes:
    """The document as a taskpoint before the pair wrote it."""
    return json.dumps({k: v for k, v in json.loads(data).items() if k not in ("format", "version")}).encode()


def test_a_lease_carries_its_form_and_reads_with_or_without_it() -> None:
    body = lease_body(30.0, beat=2.0)
    doc = json.loads(body)
    assert (doc["format"], doc["version"], format_problems(doc)) == (LEASE_FORMAT, VERSIONS[LEASE_FORMAT], None)
    assert (recorded_grace(body), recorded_beat(body)) == (30.0, 2.0)
    assert (recorded_grace(_older(body)), recorded_beat(_older(body))) == (30.0, 2.0)
    assert recorded_grace(_newer(body)) is None  # as an unreadable body: judged by the judge's own grace


def test_the_chunk_epoch_is_a_document_of_its_own_and_every_new_one_differs() -> None:
    first, second = new_epoch(), new_epoch()
    doc = json.loads(first)
    assert (doc["format"], format_problems(doc)) == (EPOCH_FORMAT, None)
    assert first != second and re.fullmatch("[0-9a-f]{32}", read_small_document(first, EPOCH_FORMAT)["epoch"])


def test_a_group_record_carries_its_form_and_a_newer_one_is_absent(tmp_path: Path) -> None:
    group = StorageGroup(Location(str(tmp_path / "group")), Ranks(rank=1, world_size=2), "round-1", 5.0)
    group.publish("vote", {"step": 7})
    data = (tmp_path / "group" / "vote-1.json").read_bytes()
    doc = json.loads(data)
    assert (doc["format"], doc["version"], format_problems(doc)) == (GROUP_FORMAT, VERSIONS[GROUP_FORMAT], None)
    assert group.records("vote")[1].value == {"step": 7}
    (tmp_path / "group" / "vote-1.json").write_bytes(_older(data))
    assert group.records("vote")[1].value == {"step": 7}
    (tmp_path / "group" / "vote-1.json").write_bytes(_newer(data))
    assert group.records("vote") == {} and Record.from_bytes(_newer(data)) is None


def test_the_attempt_marker_carries_its_form_and_a_newer_one_is_not_resumed_from(tmp_path: Path) -> None:
    store = ActionStore(str(tmp_path), "run", "action", None, ranks=Ranks(rank=0, world_size=2))
    store.begin(1)
    marker = tmp_path / "run" / "action" / "1" / "attempt.json"
    doc = json.loads(marker.read_bytes())
    assert (doc["format"], doc["world_size"], format_problems(doc)) == (ATTEMPT_FORMAT, 2, None)
    assert read_small_document(_older(marker.read_bytes()), ATTEMPT_FORMAT)["world_size"] == 2
    with pytest.raises(NewerFormatError, match="upgrade taskpoint"):
        read_small_document(_newer(marker.read_bytes()), ATTEMPT_FORMAT)


@pytest.mark.parametrize("data", [b"[]", b'{"format": "taskpoint.lease", "version": 1}',
                                  b'{"format": "taskpoint.group", "version": "1"}', b'{"version": 1}'])
def test_another_format_or_a_malformed_version_is_unreadable(data: bytes) -> None:
    with pytest.raises(ValueError):
        read_small_document(data, GROUP_FORMAT)
