"""Every stored form taskpoint ever wrote, read by today's taskpoint: the corpus under tests/corpus/, written once by
the code of each time (README.md there says which commit wrote which folder, and how).

Each stored checkpoint or step is read and verified whole (and restored to the bytes its writer was given); a copy
with one flipped byte of its data, or with its manifest cut short, is refused as damaged; a copy whose version is
edited to one from the future (sealed again, as a newer taskpoint would write it) is refused with "upgrade
taskpoint", never as damage. Local disk only: what is tested is the stored bytes, not the store.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from taskpoint import Checkpoint, CheckpointManager
from taskpoint.cli import main
from taskpoint.digests import DIGESTS
from taskpoint.errors import CheckpointCorruptError, NewerFormatError
from taskpoint.format.records import RECORD_SUFFIX, ShardRecord
from taskpoint.format.sealing import CHECK, CRC32, SHA256, check_of

CORPUS = Path(__file__).resolve().parent / "corpus"
sys.path.insert(0, str(CORPUS))
import generate  # noqa: E402  (the corpus's own script: what each stored step was given)

#: Exit codes of ``taskpoint verify``.
HEALTHY, DAMAGED = 0, 2
#: A version no taskpoint writes yet.
FUTURE = 99
#: What a reader says of a newer document.
UPGRADE = "upgrade taskpoint"
#: Every stored sample: ``<commit>/<what>``.
SAMPLES = sorted(f"{p.parent.name}/{p.name}" for p in CORPUS.glob("*/*") if p.is_dir())
#: The folders whose data needs an extra.
NEEDS = {"step_dcp": "torch", "step_state_dict": "torch", "step_pytree": "jax", "step_ranks": "torch"}


def _what(sample: str) -> str:
    return sample.split("/")[1]


def _copy(sample: str, tmp_path: Path) -> Path:
    if _what(sample) in NEEDS:
        pytest.importorskip(NEEDS[_what(sample)])
    return Path(shutil.copytree(CORPUS / sample, tmp_path / sample))


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _documents(root: Path) -> list[Path]:
    """The sealed (or, older, unsealed) documents of a sample: records, manifests, file-set manifests."""
    return sorted(p for p in root.rglob("*") if p.is_file() and (
        p.name.endswith((RECORD_SUFFIX, ".dcp.json", ".files.json")) or p.name in ("taskpoint.json",)
        or (p.name.startswith("rank-") and p.suffix == ".json")))


def _data(root: Path) -> Path:
    """The largest file that is no document: a payload, a chunk, a DCP data file, a state dict's file."""
    documents = set(_documents(root))
    return max((p for p in root.rglob("*") if p.is_file() and p not in documents and p.name != ".metadata"),
               key=lambda p: (p.stat().st_size, p.as_posix()))


def _load(stored: Path) -> Path | None:
    """A load of the checkpoint at ``stored``, as the next attempt does (saving elsewhere, resuming from it)."""
    return Checkpoint(str(stored.parent / "next"), str(stored)).load_sync()


def _verify(root: Path) -> int:
    target = root / "ckpt" if (root / "ckpt").exists() else root / "steps"
    return main(["verify", str(target)])


def _restored(root: Path, what: str) -> None:
    """Read the sample as a user would, and check it holds what its writer was given."""
    if what.startswith("checkpoint_"):
        loaded = _load(root / "ckpt")
        assert loaded is not None
        if what == "checkpoint_bytes":
            assert loaded.read_bytes() == generate.BYTES
        else:
            assert _tree(loaded) == generate.TREE
        return
    with CheckpointManager(str(root / "steps"), preemption=False) as manager:
        for step in manager.steps():
            assert manager.metadata(step) == generate.METADATA
        if what == "step_payload":
            assert manager.restore(1).read_bytes() == generate.BYTES
            assert _tree(manager.restore(2)) == generate.TREE
        elif what == "step_chunked":
            assert _tree(manager.restore(1)) == generate.TREE
        elif what == "step_sharded":
            assert manager.steps() == [1]
            for rank in (0, 1):  # each rank's manager restores its own shard
                with CheckpointManager(str(root / "steps"), rank=rank, world_size=2, preemption=False) as ranked:
                    assert ranked.restore(1).read_bytes() == generate.BYTES + bytes([rank])
        elif what == "step_state_dict":
            import torch

            import taskpoint.torch

            state = taskpoint.torch.load_state_dict_sync(manager, 1)
            assert all(torch.equal(state[k], v) for k, v in generate._small_state().items())
        elif what == "step_dcp":
            import torch
            import torch.distributed.checkpoint as dcp

            import taskpoint.torch

            target = {k: torch.zeros_like(v) for k, v in generate._small_state().items()}  # type: ignore[attr-defined]
            dcp.load(target, storage_reader=taskpoint.torch.Reader.for_step(manager, 1))
            assert all(torch.equal(target[k], v) for k, v in generate._small_state().items())
        elif what == "step_ranks":  # 3 ranks: state dicts from ranks 0 and 1, bytes from rank 2
            import torch

            import taskpoint.torch

            assert manager.steps() == [1]
            for rank in range(generate.RANKS_WORLD):
                with CheckpointManager(str(root / "steps"), rank=rank, world_size=generate.RANKS_WORLD,
                                       preemption=False) as ranked:
                    if rank == generate.RANKS_WORLD - 1:
                        assert ranked.restore(1).read_bytes() == generate.BYTES + bytes([rank])
                    else:
                        state = taskpoint.torch.load_state_dict_sync(ranked, 1)
                        assert all(torch.equal(state[k], v) for k, v in generate.ranks_state(rank).items())
        elif what == "step_pytree":
            folder = manager.restore(1)
            assert (folder / "taskpoint-pytree.json").exists() or any(folder.rglob("taskpoint-pytree.json"))


@pytest.mark.parametrize("sample", SAMPLES)
def test_every_stored_form_reads_and_verifies(sample: str, tmp_path: Path) -> None:
    root, what = _copy(sample, tmp_path), _what(sample)
    if what == "shard_record":  # a rank's record of an uncommitted step: read by rank 0, which checks the payload
        record = ShardRecord.from_bytes((root / "steps/ckpt-1/rank-1.json").read_bytes(), "rank-1.json")
        payload = root / "steps/ckpt-1" / record.shard.payload
        assert record.shard.record.size == payload.stat().st_size and record.world_size == 2
        return
    assert _verify(root) == HEALTHY
    _restored(root, what)


@pytest.mark.parametrize("sample", SAMPLES)
def test_a_flipped_byte_of_the_data_is_damage(sample: str, tmp_path: Path) -> None:
    root, what = _copy(sample, tmp_path), _what(sample)
    data = _data(root)
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    data.write_bytes(bytes(damaged))
    if what == "shard_record":
        record = ShardRecord.from_bytes((root / "steps/ckpt-1/rank-1.json").read_bytes(), "rank-1.json").shard.record
        assert record.digest is not None
        hasher = DIGESTS[record.hash_name]()
        hasher.update(data.read_bytes())
        assert (record.hash_name, hasher.hexdigest()) != record.digest
        return
    assert _verify(root) == DAMAGED


@pytest.mark.parametrize("sample", SAMPLES)
def test_a_truncated_document_is_damage_not_newer(sample: str, tmp_path: Path) -> None:
    root = _copy(sample, tmp_path)
    for document in _documents(root):
        original = document.read_bytes()
        document.write_bytes(original[:len(original) // 2])
        _refused(root, document, damaged=True)
        document.write_bytes(original)


@pytest.mark.parametrize("sample", SAMPLES)
def test_a_document_from_the_future_asks_for_an_upgrade(sample: str, tmp_path: Path) -> None:
    root = _copy(sample, tmp_path)
    for document in _documents(root):
        original = document.read_bytes()
        doc = json.loads(original)
        doc["version"] = FUTURE
        if CHECK in doc:  # as a newer taskpoint would write it: sealed again
            doc[CHECK] = check_of(doc, CRC32 if document.name.endswith(RECORD_SUFFIX) else SHA256)
        document.write_bytes(json.dumps(doc, sort_keys=True).encode())
        _refused(root, document, damaged=False)
        document.write_bytes(original)


def _refused(root: Path, document: Path, *, damaged: bool) -> None:
    """Reading ``document`` (directly, as its reader does) is CheckpointCorruptError: damage, or "upgrade"."""
    with pytest.raises(CheckpointCorruptError) as caught:
        _read_document(root, document)
    said = " ".join(str(caught.value).split())
    assert (UPGRADE not in said) if damaged else (UPGRADE in said), said
    assert isinstance(caught.value, NewerFormatError) is not damaged, type(caught.value)


def _read_document(root: Path, document: Path) -> None:
    from taskpoint.format.fileset import FileSetManifest

    data = document.read_bytes()
    if document.name.endswith(RECORD_SUFFIX):
        _load(document.with_name(document.name.removesuffix(RECORD_SUFFIX)))
    elif document.name.startswith("rank-"):
        ShardRecord.from_bytes(data, str(document))
    elif document.name.endswith((".dcp.json", ".files.json")):
        FileSetManifest.from_bytes(data, str(document))
    else:
        with CheckpointManager(str(document.parent.parent), preemption=False) as manager:
            manager.describe(int(document.parent.name.removeprefix("ckpt-")))
