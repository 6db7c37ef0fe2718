"""docs/format.md keeps up with the code: every version of every sealed document that this taskpoint reads is a
row of the specification's version table, the table names no version the code cannot read, and every stored name
the code defines appears in the specification.

The versions are found by asking the readers themselves (a sealed probe of each version, until the reader refuses
one as newer), not by a list kept here, so a new version in the code fails this test until the table has its
row. Modules of the optional extras are read with ``ast``, so that the test imports neither JAX nor torch. And a
run of the core's step kinds leaves no object in a manager's directory that the specification's layout omits.
"""

from __future__ import annotations

import ast
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from taskpoint.errors import CheckpointCorruptError
from taskpoint.format import documents, fileset, records
from taskpoint.format.sealing import CRC32, SHA256, sealed
from taskpoint.manager import agreement, chunks, step_names
from taskpoint.runtime import layout

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "format.md"
#: A row of the version table: | `format` | version | ...
VERSION_ROW = re.compile(r"^\| `([^`]+)` \| (\d+) \|", re.MULTILINE)
#: Higher than any version a reader could plausibly read: a reader that never says "newer" fails the probe.
PROBE_LIMIT = 100
#: What :func:`taskpoint.format.sealing.parse` says of a version newer than its reader's.
NEWER = "newer than this taskpoint understands"

Reader = Callable[[bytes, str], object]


def _no_kind(kind: str) -> Callable[[dict[str, object]], records.StepContent]:
    raise ValueError(f"the probe names no kind ({kind})")


#: Each sealed document: its format name, the digest of its check, and its reader.
SEALED: list[tuple[str, str, Reader]] = [
    (records.FORMAT, CRC32, records.Record.from_bytes),
    (records.STEP_FORMAT, SHA256, lambda data, uri: records.StepManifest.from_bytes(data, uri, _no_kind)),
    (records.SHARD_FORMAT, SHA256, records.ShardRecord.from_bytes),
    (fileset.FILESET_FORMAT, SHA256, fileset.FileSetManifest.from_bytes),
]


def newest_read(fmt: str, digest: str, reader: Reader) -> int:
    """The newest version of ``fmt`` that ``reader`` reads: the one below the first it refuses as newer."""
    for version in range(1, PROBE_LIMIT):
        try:
            reader(sealed({"format": fmt, "version": version}, digest), "probe")
        except CheckpointCorruptError as exc:
            if NEWER in str(exc):
                return version - 1
    raise AssertionError(f"the reader of {fmt} refused no version up to {PROBE_LIMIT} as newer")


def module_constant(module: str, name: str) -> object:
    """The literal value of ``name`` assigned at the top of ``src/taskpoint/<module>.py`` (read, not imported)."""
    tree = ast.parse((ROOT / "src" / "taskpoint" / f"{module}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{module}.py defines no {name}")


def documented_versions(spec: Path = SPEC) -> set[tuple[str, int]]:
    """The (format, version) rows of the version table of ``spec``."""
    return {(fmt, int(version)) for fmt, version in VERSION_ROW.findall(spec.read_text(encoding="utf-8"))}


def code_versions() -> set[tuple[str, int]]:
    """Every (format, version) this taskpoint reads: versions 1 to the newest of each sealed document and of each
    small document (:mod:`taskpoint.format.documents`), and the one version of the JAX sidecar (its reader refuses
    any other)."""
    found = {(fmt, version) for fmt, digest, reader in SEALED
             for version in range(1, newest_read(fmt, digest, reader) + 1)}
    found |= {(fmt, version) for fmt, newest in documents.VERSIONS.items() for version in range(1, newest + 1)}
    sidecar = module_constant("jax/_pytree", "SIDECAR_NAME")
    found.add((str(sidecar), int(str(module_constant("jax/_pytree", "FORMAT_VERSION")))))
    return found


def test_the_version_table_lists_every_version_the_code_reads_and_no_other() -> None:
    documented, code = documented_versions(), code_versions()
    assert code - documented == set(), "versions the code reads that docs/format.md's version table lacks"
    assert documented - code == set(), "versions docs/format.md lists that no reader of the code accepts"


def test_every_version_the_code_writes_is_in_the_version_table() -> None:
    written = {(records.FORMAT, records.RECORD_VERSION), (records.FORMAT, records.RECORD_VERSION_UNINDEXED),
               (records.STEP_FORMAT, records.FORMAT_VERSION), (records.STEP_FORMAT, records.KIND_VERSION),
               (records.STEP_FORMAT, records.BLAKE3_VERSION), (records.SHARD_FORMAT, records.SHARD_VERSION),
               (fileset.FILESET_FORMAT, fileset.FILESET_VERSION),
               *((records.STEP_FORMAT, version) for version in records.LEGACY_VERSIONS.values()),
               *documents.VERSIONS.items()}
    assert written - documented_versions() == set()


def test_the_probe_finds_the_newest_version_of_each_reader() -> None:
    """The probe itself can tell: it finds the constants the readers are given."""
    newest = {fmt: newest_read(fmt, digest, reader) for fmt, digest, reader in SEALED}
    assert newest[records.FORMAT] == records.RECORD_VERSION
    assert newest[records.STEP_FORMAT] == records.FORMAT_VERSION
    assert newest[records.SHARD_FORMAT] == records.SHARD_VERSION
    assert newest[fileset.FILESET_FORMAT] == fileset.FILESET_VERSION


def test_a_version_missing_from_the_table_is_found(tmp_path: Path) -> None:
    """The check fails when the specification falls behind: a table without the newest step manifest row."""
    text = SPEC.read_text(encoding="utf-8")
    row = re.search(rf"^\| `{re.escape(records.STEP_FORMAT)}` \| {records.FORMAT_VERSION} \|.*\n", text, re.MULTILINE)
    assert row is not None
    behind = tmp_path / "format.md"
    behind.write_text(text.replace(row.group(0), ""), encoding="utf-8")
    assert code_versions() - documented_versions(behind) == {(records.STEP_FORMAT, records.FORMAT_VERSION)}


@pytest.mark.parametrize("name", [
    records.RECORD_SUFFIX, step_names.MANIFEST_NAME, chunks.CHUNK_FOLDER, chunks.LEASE_FOLDER, chunks.EPOCH_NAME,
    agreement.AGREEMENT_FOLDER, layout.ATTEMPT_MARKER, layout.RENDEZVOUS_FOLDER, layout.CHECKPOINT_NAME,
    layout.STEPS_FOLDER, step_names.commit_lease_name("{id}"), step_names.shard_record_name(7).replace("7", "{k}"),
    str(module_constant("torch/_layout", "MANIFEST_NAME")), str(module_constant("torch/_layout", "METADATA_NAME")),
    str(module_constant("jax/_pytree", "SIDECAR_NAME")), str(module_constant("jax/_pytree", "ARRAYS_FOLDER")),
])
def test_every_stored_name_is_in_the_specification(name: str) -> None:
    assert name in SPEC.read_text(encoding="utf-8")


#: What each placeholder of the specification's layout stands for.
PLACEHOLDERS = {"{step}": "(0|[1-9][0-9]*)", "{save_id}": "[0-9a-f]{32}", "{id}": "[0-9a-f]{32}",
                "{k}": "[0-9]+", "{rank}": "[0-9]+", "{n}": "[0-9]+", "{save}": "[0-9a-f]{12}", "{r}": "[0-9a-f]{12}",
                "{key[:2]}": "[0-9a-f]{2}", "{key}": "[0-9a-f]{64}[.](zst|gz|raw)"}


def specified_names(prefix: str) -> list[re.Pattern[str]]:
    """The paths the specification's layout blocks list below ``prefix`` (``{dir}/``), as patterns of paths
    relative to it; a path ending in ``/`` covers everything below it."""
    patterns = []
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        if not line.startswith(prefix):
            continue
        path = line[len(prefix):].split()[0]
        regex = re.escape(path)
        for placeholder, meaning in PLACEHOLDERS.items():
            regex = regex.replace(re.escape(placeholder), meaning)
        patterns.append(re.compile(regex + (".+" if path.endswith("/") else "")))
    return patterns


def save_on_two_ranks(directory: str | Path, step: int, **options: Any) -> None:
    """``step`` saved by two ranks (threads of this process, each its own manager), rank 0 committing."""
    from taskpoint import CheckpointManager

    errors: list[BaseException] = []

    def rank(k: int) -> None:
        try:
            with CheckpointManager(directory, rank=k, world_size=2, commit_timeout=120, **options) as ranked:
                ranked.save(f"rank {k}".encode(), step)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(k,)) for k in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors and not any(thread.is_alive() for thread in threads), errors


def test_every_object_a_manager_leaves_is_named_by_the_specification(tmp_path: Path) -> None:
    """Steps of the kinds the core writes (one payload, deduplicated, several ranks), an overwrite, a delete and
    a sweep that removes chunks (the epoch): every object left in the directory matches a path of the layout."""
    from taskpoint import CheckpointManager

    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.txt").write_text("a")
    directory = tmp_path / "steps"
    with CheckpointManager(directory) as manager:
        manager.save(source, 1, metadata={"loss": 0.5})
        manager.save(b"bytes", 2)
        manager.save(b"again", 2, overwrite=True)
    with CheckpointManager(directory, dedup=True) as dedup:
        dedup.save(source, 3)
        (source / "sub" / "a.txt").write_text("b")
        dedup.save(source, 4)
        dedup.delete(3)
        dedup.gc(0)
    save_on_two_ranks(directory, 5)
    patterns = specified_names("{dir}/")
    stored = [path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file()]
    assert {"ckpt-5/taskpoint.json", "leases/epoch"} <= set(stored)  # the run did reach every kind and the sweep
    unnamed = [name for name in stored if not any(p.fullmatch(name) for p in patterns)]
    assert unnamed == [], "objects docs/format.md's layout of a manager's directory does not name"
