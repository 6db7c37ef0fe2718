"""A state dict staged in shared memory by a background save, and the save process's write of it.

``save(StateDict(sd), step, blocking=False)`` copies each distinct tensor storage of the state once into a
segment (:mod:`taskpoint.manager.staging`), CUDA storages device-to-host with one synchronisation at the end,
and keeps the rest of the state (containers, numbers, strings, the tensors' dtypes, offsets, sizes and strides)
as a small skeleton. The save process rebuilds the state from the segment without a copy (each tensor a view of
its storage there, storages shared as they were, so tied weights stay tied) and writes the same
``torch.state_dict`` step a blocking save writes (:func:`~._state_kind.write_state`: ``torch.save`` in pieces
hashed by BLAKE3), which ``load_state_dict_sync(..., mmap=True)`` maps. CUDA tensors come back as CPU tensors
(``map_location`` places them on load).

Staged storages start on :attr:`~taskpoint.manager.staging.Segment.ALIGN`-byte boundaries, as ``torch.save`` aligns
them in its file.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

import torch

from .._progress import Progress
from ..format.records import StepManifest
from ..manager.kind_api import Segment
from ..payloads import BytesPayload
from ..storage import Location
from ._state_file import state_manifest, write_state

#: Leaves kept in the skeleton as they are (everything a state dict holds but tensors and containers).
_KEPT = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


@dataclass(frozen=True)
class _TensorRef:
    """A tensor in the skeleton: a view (offset, size and stride in elements) of staged storage ``storage``."""

    storage: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class Plan:
    """Where each distinct storage of a state goes in a segment of :attr:`size` bytes, and the state's skeleton
    (TypeError, naming it, for anything staging does not copy exactly)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.spans: list[tuple[int, int]] = []  # (offset in the segment, bytes) per storage
        self.storages: list[torch.UntypedStorage] = []
        self._index: dict[tuple[str, int], int] = {}
        self.size = 0
        self._skeleton = self.skeleton(state)

    def skeleton(self, value: Any) -> Any:
        """``value`` with each tensor replaced by a :class:`_TensorRef`; TypeError for what cannot be staged."""
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, _KEPT):
            return value
        if isinstance(value, dict):
            copy = type(value)((key, self.skeleton(item)) for key, item in value.items())
            if hasattr(value, "_metadata"):  # model.state_dict()'s module versions, which torch.save keeps
                copy._metadata = value._metadata  # type: ignore[attr-defined]
            return copy
        if isinstance(value, Mapping):
            return {key: self.skeleton(item) for key, item in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self.skeleton(item) for item in value)
        raise TypeError(f"a {type(value).__name__} cannot be staged")

    def _tensor(self, tensor: torch.Tensor) -> _TensorRef:
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.is_quantized \
                or tensor.device.type not in ("cpu", "cuda") or tensor.requires_grad:
            raise TypeError(f"a {type(tensor).__name__} on {tensor.device} ({tensor.layout}) cannot be staged")
        storage = tensor.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.spans)
            start = Segment.aligned(self.size)
            self.spans.append((start, storage.nbytes()))
            self.storages.append(storage)
            self.size = start + storage.nbytes()
        return _TensorRef(index, tensor.dtype, int(tensor.storage_offset()), tuple(tensor.size()),
                          tuple(tensor.stride()))

    def copy_into(self, segment: Segment) -> StagedStateDict:
        """Copy every storage into ``segment`` (of :attr:`size` bytes): those in host memory by
        :meth:`~taskpoint.manager.staging.Segment.fill`, those on a GPU device-to-host into its mapping here, with
        one synchronisation for all; the staged state."""
        pieces = [(start, storage) for (start, nbytes), storage in zip(self.spans, self.storages, strict=True)
                  if nbytes]
        segment.fill((start, _bytes(storage).numpy()) for start, storage in pieces if storage.device.type == "cpu")
        on_gpu = [(start, storage) for start, storage in pieces if storage.device.type == "cuda"]
        if on_gpu:
            segment.reserve()  # written through a mapping: no page may be left for the copy to allocate
            buffer = segment.buffer
            copies = [torch.frombuffer(buffer, dtype=torch.uint8, count=storage.nbytes(), offset=start).copy_(
                _bytes(storage), non_blocking=True) for start, storage in on_gpu]
            torch.cuda.synchronize()  # one wait for every device-to-host copy
            del copies, buffer  # no view of the mapping is left: it can be unmapped
        self.storages = []
        return StagedStateDict(str(segment.path), self._skeleton, tuple(self.spans))


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """``storage``'s bytes, as a tensor of bytes over them on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _rebuild(skeleton: Any, storages: list[torch.UntypedStorage]) -> Any:
    if isinstance(skeleton, _TensorRef):
        return torch.empty(0, dtype=skeleton.dtype).set_(storages[skeleton.storage], skeleton.offset,
                                                         skeleton.size, skeleton.stride)
    if isinstance(skeleton, dict):
        copy = type(skeleton)((key, _rebuild(item, storages)) for key, item in skeleton.items())
        if hasattr(skeleton, "_metadata"):
            copy._metadata = skeleton._metadata  # type: ignore[attr-defined]
        return copy
    if type(skeleton) in (list, tuple):
        return type(skeleton)(_rebuild(item, storages) for item in skeleton)
    return skeleton


def _views(segment: Segment, spans: tuple[tuple[int, int], ...]) -> list[torch.UntypedStorage]:
    buffer = segment.buffer
    return [torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start).untyped_storage() if nbytes
            else torch.empty(0, dtype=torch.uint8).untyped_storage() for start, nbytes in spans]


class StagedStateDict(BytesPayload):
    """A state dict staged in a segment (:func:`copy_into`): the payload a background save writes. Saved by the
    ``torch.state_dict`` kind through the manager's save process (:meth:`write_job`); any other way (a thread of
    this process) as its ``torch.save`` bytes, rebuilt from the segment."""

    kind = "torch.state_dict"

    def __init__(self, segment: str, skeleton: Any, spans: tuple[tuple[int, int], ...]) -> None:
        self.segment, self._skeleton, self._spans = segment, skeleton, spans

    def size(self) -> None:  # type: ignore[override]  # torch.save's size is known once written
        return None

    def write(self, sink: IO[bytes], codec: Any = None, level: int | None = None) -> None:
        raise TypeError("a staged state dict is written by the torch.state_dict step kind, from its segment")

    def write_job(self, target: tuple[str, Any, Any], name: str, save_id: str, step: int, attempt: int | None,
                  metadata: dict[str, Any]) -> StagedWrite:
        """What the save process runs to write this state as file ``name`` (``target``: its location) of a
        ``torch.state_dict`` step."""
        return StagedWrite(self._skeleton, self._spans, target, name, save_id, step, attempt, metadata)


@dataclass(frozen=True)
class StagedWrite:
    """The save process's part of a staged state-dict save: :meth:`run` writes the step's file from the
    segment and returns its size and the manifest that commits it (written by the trainer, or by the save
    process for a trainer that died)."""

    skeleton: Any
    spans: tuple[tuple[int, int], ...]
    target: tuple[str, Any, Any]
    name: str
    save_id: str
    step: int
    attempt: int | None
    metadata: dict[str, Any]

    def run(self, segment: Segment, progress: Progress) -> tuple[dict[str, int], StepManifest]:
        save = functools.partial(torch.save, _rebuild(self.skeleton, _views(segment, self.spans)))
        size, digests = write_state(Location(*self.target), save, progress)
        del save  # no view of the segment is left: it can be unmapped
        return {self.name: size}, state_manifest(self.step, self.attempt, self.metadata, self.save_id, self.name,
                                                 size, digests)
