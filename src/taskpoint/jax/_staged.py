"""A PyTree staged in shared memory by a background save, and the save process's write of it.

``save(PyTree(tree), step, blocking=False)`` walks the tree once (:func:`~._pytree.encode`: the sidecar's
structure and leaf records), copies the host bytes of each array Orbax would store into a segment
(:mod:`taskpoint.manager.staging`), sized up front from the arrays' ``nbytes``, and keeps the rest as a small
skeleton: the sidecar and, per array, where it lies in the segment, its dtype and shape, and whether it is a jax
array or a numpy one. A jax array on the CPU is its host buffer already (``np.asarray`` is a view), so that is one
copy. The save process rebuilds each array over the segment without a copy (``jax.device_put`` of an aligned
host buffer aliases it on the CPU) and writes the same ``jax.pytree`` step a blocking save writes
(:meth:`~._pytree.Encoded.write`, then the core's files and their list), so that ``load_pytree_sync`` and
``restore`` read it alike; the save process runs jax on its CPU only (:mod:`taskpoint.manager.saver`).

Staged: numpy arrays (of any dtype but object) and jax arrays on one CPU device. A tree with a jax array elsewhere
(an accelerator, or sharded over several devices) is not staged: its background save serializes it first, as
before, and stores the folder as a payload.

Staged arrays start on :attr:`~taskpoint.manager.staging.Segment.ALIGN`-byte boundaries, which the CPU client of
jax needs to alias a buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import jax
import numpy as np

from ..format.codecs import Codec
from ..manager.kind_api import Segment
from ..payloads import DirectoryPayload
from ._pytree import PAYLOAD_KIND, Encoded


@dataclass(frozen=True)
class _ArrayRef:
    """An array in the skeleton: ``dtype`` and ``shape`` at ``offset`` in the segment, a jax array or a numpy
    one."""

    offset: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    on_jax: bool


def _host(array: Any) -> np.ndarray[Any, Any] | None:
    """The host bytes of a leaf's array as numpy sees them, without a copy; None for an array staging does not
    copy (one on an accelerator or on several devices)."""
    if isinstance(array, jax.Array) and [device.platform for device in array.devices()] != ["cpu"]:
        return None
    return np.asarray(array)


class TreePlan:
    """Where each array of an encoded tree goes in a segment of :attr:`size` bytes; :attr:`size` is None when
    the tree holds an array that staging does not copy."""

    def __init__(self, encoded: Encoded) -> None:
        self._encoded = encoded
        self._sources: dict[str, np.ndarray[Any, Any]] = {}
        self._refs: dict[str, _ArrayRef] = {}
        end = 0
        for key, array in encoded.arrays.items():
            host = _host(array)
            if host is None:
                self.size: int | None = None
                return
            start = Segment.aligned(end)
            self._sources[key] = host
            self._refs[key] = _ArrayRef(start, host.dtype, tuple(host.shape), isinstance(array, jax.Array))
            end = start + host.nbytes
        self.size = end

    def copy_into(self, segment: Segment) -> StagedTree:
        """Copy every array into ``segment`` (of :attr:`size` bytes, by
        :meth:`~taskpoint.manager.staging.Segment.fill`); the staged tree."""
        segment.fill((self._refs[key].offset, np.ascontiguousarray(source).reshape(-1).view(np.uint8))
                     for key, source in self._sources.items())
        self._sources = {}
        return StagedTree(str(segment.path), Encoded(self._encoded.structure, self._encoded.leaves, self._refs))


def _view(buffer: memoryview, ref: _ArrayRef) -> np.ndarray[Any, Any]:
    count = int(np.prod(ref.shape, dtype=np.int64))
    return np.frombuffer(buffer, dtype=ref.dtype, count=count, offset=ref.offset).reshape(ref.shape)


class StagedTree(DirectoryPayload):
    """A PyTree staged in a segment (:meth:`TreePlan.copy_into`): the payload a background save writes, by the
    ``jax.pytree`` step kind, through the manager's save process (:class:`~._kind.StagedTreeWrite`), or from a
    thread of this process when there is none."""

    kind = PAYLOAD_KIND

    def __init__(self, segment: str, skeleton: Encoded) -> None:
        #: The segment's path, and the tree encoded with each array an :class:`_ArrayRef` into it.
        self.segment, self.skeleton = segment, skeleton

    def write(self, sink: IO[bytes], codec: Codec, level: int | None,
              on_read: Callable[[int], None] | None = None) -> None:
        raise TypeError("a staged PyTree is written by the jax.pytree step kind, from its segment")


def rebuilt(segment: Segment, skeleton: Encoded) -> Encoded:
    """The staged tree of ``skeleton``, each array over the segment's bytes: a numpy view, or a jax array aliasing
    them (no copy on the CPU, the arrays being aligned)."""
    buffer = segment.buffer
    return Encoded(skeleton.structure, skeleton.leaves, {
        key: jax.device_put(_view(buffer, ref)) if ref.on_jax else _view(buffer, ref)
        for key, ref in skeleton.arrays.items()})
