"""taskpoint.torch.Reader checks a DCP data file's BLAKE3 pieces beside the load, not before it: what a load hands
the planner has matched its piece, a load of some items checks only the pieces they lie in, and a full load every
piece it reads (a flipped byte, a file cut short or extended: CheckpointCorruptError naming the file and piece).

One process on local disk (DCP without a process group); the file is one of several 16 MiB pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers import LazyModule, requires
from taskpoint.errors import CheckpointCorruptError

torch = LazyModule("torch")
dcp = LazyModule("torch.distributed.checkpoint")
dcp_api = LazyModule("torch.distributed.checkpoint.api")
tp_torch = LazyModule("taskpoint.torch")

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"), requires("torch")]

PIECE = 16 << 20
#: Three tensors of 20 MiB in one file of four pieces: "a" in pieces 0-1, "b" in 1-2, "c" in 2-3.
NAMES = ("a", "b", "c")


def _state(fill: float | None = None) -> dict[str, Any]:
    if fill is not None:
        return {name: torch.full((5 << 20,), fill) for name in NAMES}
    generator = torch.Generator().manual_seed(3)
    return {name: torch.randn(5 << 20, generator=generator) for name in NAMES}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of the three tensors, written as one data file by taskpoint's Writer."""
    state = _state()
    dcp.save(state, storage_writer=tp_torch.Writer(str(tmp_path / "ckpt"), threads=1))
    (data,) = (tmp_path / "ckpt").glob("*.distcp")
    listed = json.loads((tmp_path / "ckpt" / "taskpoint.dcp.json").read_bytes())["files"][data.name]
    assert len(listed["pieces"]) == 4 and listed["piece_hash"] == "blake3"
    return tmp_path / "ckpt", state


def _data(folder: Path) -> Path:
    (data,) = folder.glob("*.distcp")
    return data


def _flip(path: Path, at: int) -> None:
    content = bytearray(path.read_bytes())
    content[at] ^= 0x20
    path.write_bytes(bytes(content))


def _where(path: Path, tensor: Any) -> int:
    """Where ``tensor``'s bytes start in the data file."""
    at = path.read_bytes().find(tensor.numpy().tobytes()[:4096])
    assert at >= 0
    return at


def _load_error(folder: Path, target: dict[str, Any]) -> BaseException:
    with pytest.raises(dcp_api.CheckpointException) as caught:
        dcp.load(target, storage_reader=tp_torch.Reader(str(folder)))
    ((error, _),) = caught.value.failures.values()
    return error


def test_a_full_load_matches_and_a_flipped_byte_is_refused_naming_file_and_piece(saved: Any) -> None:
    folder, state = saved
    target = _state(0.0)
    dcp.load(target, storage_reader=tp_torch.Reader(str(folder)))
    assert all(torch.equal(target[name], state[name]) for name in NAMES)

    data = _data(folder)
    _flip(data, 3 * PIECE + 100)  # in "c", in the last piece
    error = _load_error(folder, _state(0.0))
    assert isinstance(error, CheckpointCorruptError)
    assert data.name in str(error) and "piece 3" in str(error) and "blake3" in str(error)


def test_no_byte_of_a_damaged_piece_reaches_a_tensor(saved: Any) -> None:
    """The bytes of "b" lie in pieces 1 and 2; a flipped byte in piece 2 leaves the target of "b" as it was, and
    "a", loaded from pieces that matched before it, holds what was saved."""
    folder, state = saved
    data = _data(folder)
    at = _where(data, state["b"]) + (5 << 20) * 4 - 100  # the last bytes of "b"
    assert at // PIECE == 2
    _flip(data, at)
    target = _state(0.0)
    error = _load_error(folder, target)
    assert isinstance(error, CheckpointCorruptError) and "piece 2" in str(error)
    assert torch.equal(target["a"], state["a"])
    assert torch.equal(target["b"], torch.zeros(5 << 20))


def test_a_load_of_some_items_checks_the_pieces_they_lie_in(saved: Any) -> None:
    """A load of "a" alone reads pieces 0 and 1: damage in piece 3 does not stop it; a load of "c" refuses it."""
    folder, state = saved
    _flip(_data(folder), 3 * PIECE + 100)
    only_a = {"a": torch.zeros(5 << 20)}
    dcp.load(only_a, storage_reader=tp_torch.Reader(str(folder)))
    assert torch.equal(only_a["a"], state["a"])
    error = _load_error(folder, {"c": torch.zeros(5 << 20)})
    assert isinstance(error, CheckpointCorruptError) and "piece 3" in str(error)


@pytest.mark.parametrize("change", ["truncated", "extended"])
def test_a_file_cut_short_or_extended_is_refused(saved: Any, change: str) -> None:
    folder, _ = saved
    data = _data(folder)
    content = data.read_bytes()
    data.write_bytes(content[:-10] if change == "truncated" else content + b"\0")
    error = _load_error(folder, _state(0.0))
    assert isinstance(error, CheckpointCorruptError)
    assert data.name in str(error) and "piece 3" in str(error) and "truncated or extended" in str(error)
