"""The one table of the readers of forms taskpoint no longer writes (taskpoint.format.legacy): each entry reads its
form into today's, and the specification's version table marks the versions no longer written that the table
reads. The corpus (test_stored_corpus) reads real documents of most forms; the file set of version 2, written only
for a PyTree with a file over 16 MiB, is built here by hand from the specification."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from taskpoint.format import legacy
from taskpoint.format.fileset import PIECE_SIZE, FileSetManifest, entry_of, pieces_digest
from taskpoint.format.names import FILESET_FORMAT
from taskpoint.format.sealing import sealed

SPEC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


def test_the_table_names_each_form_once_with_the_commit_of_its_successor() -> None:
    forms = [(r.format, r.version, r.sealed) for r in legacy.OLDER_READERS]
    assert len(forms) == len(set(forms))
    assert all(re.fullmatch(r"[0-9a-f]{7} \(2026-\d\d-\d\d\)", r.since) for r in legacy.OLDER_READERS)
    assert all(legacy.older_reader(*form) is not None for form in forms)


def test_every_version_the_specification_says_is_only_read_has_a_reader_in_the_table() -> None:
    only_read = re.findall(r"^\| `([^`]+)` \| (\d+) \|.*\| no[;(][^|]*read \|$", SPEC.read_text(), re.MULTILINE)
    assert only_read, "the version table marks no version as read only"
    for fmt, version in only_read:
        assert any((r.format, r.version) == (fmt, int(version)) for r in legacy.OLDER_READERS), (fmt, version)


def test_a_version_2_file_set_reads_its_sha256_pieces_as_named() -> None:
    data = bytes(range(256)) * 7
    digest = hashlib.sha256(data).hexdigest()
    doc = {"format": FILESET_FORMAT, "version": 2, "kind": "jax.orbax", "save_id": "0" * 32, "created": 1.0,
           "attempt": None, "metadata": {},
           "files": {"big": {"size": len(data), "sha256": pieces_digest([digest]), "piece_size": PIECE_SIZE,
                             "pieces": [digest]},
                     "small": {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}}}
    manifest = FileSetManifest.from_bytes(sealed(doc), "v2")
    assert manifest.files["big"].piece_hash == legacy.UNNAMED_PIECE_HASH
    assert entry_of(data, manifest.files["big"].piece_hash) == manifest.files["big"]
    assert entry_of(b"abc", None) == manifest.files["small"]
