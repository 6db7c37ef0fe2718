"""A payload object read as another number of 16 MiB pieces than its manifest records (truncated or extended by a
piece or more after the save, or split wrong by a reader, as the empty read at a stream's end once did) is damage
that says so: "read 1 piece of payload-... (N bytes), the manifest records 2 (M bytes)", from verify and from a
restore, on local disk (positional reads) and on memory:// (the streamed reads of every object store)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest

from taskpoint import CheckpointManager
from taskpoint.errors import CheckpointCorruptError
from taskpoint.format.fileset import PIECE_SIZE

#: What is saved: two pieces once stored (random bytes: gzip cannot shrink them below one).
DATA = random.Random(42).randbytes(PIECE_SIZE + (1 << 20))
#: How the stored object is changed, and how many pieces it then has.
CHANGES: dict[str, tuple[Callable[[bytes], bytes], int]] = {
    "truncated": (lambda stored: stored[:PIECE_SIZE // 2], 1),
    "extended": (lambda stored: stored + bytes(PIECE_SIZE), 3),
}


def _directory(where: str, tmp_path: Path) -> str:
    return str(tmp_path / "steps") if where == "local" else f"memory://tp-{uuid.uuid4().hex}"


def _change(directory: str, edit: Callable[[bytes], bytes]) -> tuple[str, int, int]:
    """Apply ``edit`` to step 1's payload object: its name, its size before and after."""
    fs, root = fsspec.core.url_to_fs(directory)
    (path,) = fs.glob(f"{root}/ckpt-1/payload-*")
    stored = fs.cat_file(path)
    fs.pipe_file(path, edit(stored))
    return path.rpartition("/")[2], len(stored), len(edit(stored))


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_another_number_of_pieces_is_damage_that_counts_them(where: str, change: str, tmp_path: Path) -> None:
    edit, found = CHANGES[change]
    directory = _directory(where, tmp_path)
    with CheckpointManager(directory, preemption=False) as manager:
        manager.save(DATA, 1)
        assert len(manager.describe(1).pieces) == 2
        name, saved, now = _change(directory, edit)
        said = (f"step 1 in {manager.directory} is damaged: read {found} piece{'s' if found > 1 else ''} of {name} "
                f"({now} bytes), the manifest records 2 ({saved} bytes)")
        (result,) = manager.verify().steps
        assert result.state == "damaged" and said in result.detail, result.detail
        with pytest.raises(CheckpointCorruptError) as caught:
            manager.restore(1, tmp_path / "restored")
        assert said in str(caught.value)


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_state_dicts_file_of_another_number_of_pieces_is_damage_that_counts_them(
        where: str, change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a file a step lists by its pieces (a state dict's, of 4 KiB pieces here), as verify reads it:
    by positional reads on local disk, streamed from memory://."""
    torch = pytest.importorskip("torch")
    import taskpoint.torch as tpt

    monkeypatch.setattr("taskpoint.torch._state_file.PIECE_SIZE", 4096)
    directory = _directory(where, tmp_path)
    with CheckpointManager(directory, preemption=False) as manager:
        manager.save(tpt.StateDict({"big": torch.arange(5000, dtype=torch.float32)}), 1)  # 20 KB: 5 or 6 pieces
        recorded = manager.describe(1).details["pieces"]
        fs, root = fsspec.core.url_to_fs(directory)
        (path,) = fs.glob(f"{root}/ckpt-1/state-*.pt")
        stored = fs.cat_file(path)
        changed = stored[:4096 * 2 + 10] if change == "truncated" else stored + bytes(4096)
        fs.pipe_file(path, changed)
        found = -(-len(changed) // 4096)
        (result,) = manager.verify().steps
        said = (f"step 1 in {manager.directory} is damaged: read {found} pieces of {path.rpartition('/')[2]} "
                f"({len(changed)} bytes), the manifest records {recorded} ({len(stored)} bytes)")
        assert result.state == "damaged" and said in result.detail, result.detail
