"""One read of a step however many ranks restore it: the ranks split the reads and exchange the rest.

``restore(..., broadcast=True)`` on every rank of a job with a ``torch.distributed`` process group: each rank
says which objects of which step it needs (one all-gather); the objects every rank needs are cut into
:data:`BLOCK` ranges, dealt out to the ranks by bytes, and each rank reads only its own ranges from the store
into a local copy of the step's folder; then every range is broadcast from the rank that read it to the others
(gloo here, NCCL on GPUs), in order, through one buffer of :data:`BLOCK` bytes. The step's kind then restores
from that copy as it would from the store, checking every byte against the manifest's digests (its sha256, its
pieces' or files' digests): a byte flipped on the store fails every rank with CheckpointCorruptError naming the
object.

The ranks that need the same bytes are those that restore the same object: the same name and size in the same
step (and save) of the same directory. For a step of one payload, a chunked step's pieces, a DCP file set or a
PyTree that is every rank restoring that step; for a sharded step, no two ranks (each reads its own shard, read
by it alone); and where ranks restore different steps or directories (each pipeline stage its own manager, its
data-parallel replicas restoring the stage's step) each set of ranks that reads the same objects shares them:
its ranks split the reads and the bytes are broadcast within a process group of those ranks alone, so that no
rank receives the bytes of objects it does not restore. Deduplicated steps (chunks of the chunk store) are read
by each rank itself.

Every collective waits at most the manager's ``commit_timeout``, and the wait ends in a TimeoutError naming this
rank and what it waited for (a CheckpointError when the group fails sooner, a rank gone); a rank that cannot read
its share tells the others through one more all-gather, and all of them raise an error naming that rank, the
object and its range. The copy lives in a temporary folder until the restore returns (or, for
``restore_in_place``, until its block exits).

Measured (4 gloo ranks on 2 shared cores): broadcasting 256 MiB in 16 MiB blocks took 0.39 s; 4 ranks restoring
a 256 MiB step from moto read 1.00 copy of it in 0.78x the time of each rank reading it, 4.00 copies
(``python -m benchmarks --methods broadcast``, docs/distributed.md).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import _log
from ..errors import CheckpointCorruptError, CheckpointError, add_note
from ..executors import IO
from ..format.records import StepManifest
from ..group import TorchGroup
from ..storage import Location
from .in_use import InUse
from .kinds import Gone, StepContext, StepKind
from .steps import StepStore

#: Bytes of one ranged read and of one broadcast: a rank holds one such buffer for the exchange, and each
#: reading thread one. 16 MiB blocks broadcast 256 MiB among 4 gloo ranks at 0.66 GB/s here.
BLOCK = 16 << 20
#: Ranged reads in flight per rank while it reads its share.
READERS = 4


@dataclass(frozen=True)
class _Block:
    """``length`` bytes of the object ``name`` from ``start``, read from the store by rank ``owner``."""

    name: str
    start: int
    length: int
    owner: int


class Exchange:
    """The default process group of ``torch.distributed``, for the reads of one restore (:func:`shared_reads`)."""

    def __init__(self, group: TorchGroup) -> None:
        self._group, self._torch, self._device = group, group.torch, group.device
        self.rank, self.world = group.rank, group.world
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._copies: dict[tuple[int, str], StepContext] = {}  # by step and save id: a second read of it is local
        self._subgroups: dict[tuple[int, ...], Any] = {}  # by their ranks: made once, by every rank in one order

    def close(self) -> None:
        """Remove the local copies of the steps read."""
        if self._folder is not None:
            self._folder.cleanup()
        self._copies.clear()

    # -- the step, read once among the ranks ---------------------------------------------------------------

    def mirror(self, context: StepContext, kind: StepKind, step: int, manifest: StepManifest) -> StepContext:
        """``context`` whose step store reads ``step`` from a local copy of the objects its kind restores, each
        read from the store by one of the ranks that restore it and sent to the others of them (see the module);
        ``context`` itself when no ranks share an object (each rank's own shard) or the step's are not all in its
        folder (a deduplicated step's chunks): each rank then reads for itself. Every rank calls this together,
        once per step it restores.
        :class:`Gone` when an object is missing."""
        key = (step, manifest.record.save_id)
        if key in self._copies:
            return self._copies[key]
        began, steps = time.monotonic(), context.steps
        wanted = _wanted(context, kind, step, manifest)
        mine: list[Any] | None = None if wanted is None else [steps.directory, step, manifest.record.save_id, wanted]
        sharing = _sharing(self._group.all_gather(mine, f"the objects of step {step}"))
        if not sharing:  # the same answer on every rank: no collective follows
            return context
        groups = [(ranks, names, self._subgroup(ranks)) for ranks, names in sharing]
        sizes = wanted or {}  # a rank that reads chunks too is in no group, and takes part in the collectives only
        shared = {name for ranks, names, _ in groups if self.rank in ranks for name in names}
        blocks = [block for ranks, names, _ in groups if self.rank in ranks for block in _deal(names, sizes, ranks)]
        blocks += _deal(sorted(set(sizes) - shared), sizes, [self.rank])
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="taskpoint-broadcast-")
        copy = _Copy(Path(self._folder.name, str(len(self._copies))), steps)
        for name, size in sizes.items():
            path = Path(copy.object(step, name).path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as out:
                out.truncate(size)
        read = self._read_share(steps, copy, step, [b for b in blocks if b.owner == self.rank])
        for ranks, names, within in groups:  # in the same order on every rank
            if self.rank in ranks:
                self._send_all(copy, step, [b for b in blocks if b.name in names], within)
        if wanted is None:
            return context
        _log.logger.info("restore of step %d in %s: %d bytes of %d objects read once among the %d ranks that read "
                         "them, %d bytes by rank %d and the rest received over the process group, in %.2f s", step,
                         steps.directory, sum(wanted[name] for name in shared), len(shared),
                         len({rank for ranks, _, _ in groups if self.rank in ranks for rank in ranks}), read,
                         self.rank, time.monotonic() - began)
        self._copies[key] = replace(context, steps=copy)
        return self._copies[key]

    def _subgroup(self, ranks: list[int]) -> Any:
        """The process group of ``ranks`` (:meth:`TorchGroup.subgroup`), made at its first use: every rank comes
        here for the same groups in the same order (they follow from one all-gather)."""
        key = tuple(ranks)
        if key not in self._subgroups:
            self._subgroups[key] = self._group.subgroup(ranks)
        return self._subgroups[key]

    def _read_share(self, steps: StepStore, copy: StepStore, step: int, blocks: list[_Block]) -> int:
        """Read this rank's ``blocks`` of ``step`` from the store into the copy (:data:`READERS` at once), then
        learn whether every rank read its own: the first error of a rank, raised on every rank, names it, the
        object and the range. The bytes read."""
        def read(block: _Block) -> int:
            data = steps.object(step, block.name).read_range(block.start, block.length)
            if len(data) != block.length:
                raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: {block.name} holds fewer "
                                             "bytes than its manifest records")
            fd = os.open(copy.object(step, block.name).path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.pwrite(fd, data, block.start)
            finally:
                os.close(fd)
            return block.length

        failure: dict[str, Any] | None = None
        error: BaseException | None = None
        with IO.lane(READERS) as lane:
            futures = [(block, lane.submit(read, block)) for block in blocks]
            for block, future in futures:
                try:
                    future.result()
                except Exception as exc:
                    error = error or exc
                    failure = failure or {"name": block.name, "start": block.start, "length": block.length,
                                          "missing": isinstance(exc, FileNotFoundError), "error": str(exc),
                                          "damaged": isinstance(exc, CheckpointCorruptError)}
        reports = self._group.all_gather(failure, f"whether every rank read its share of step {step}")
        for rank, report in enumerate(reports):
            if report is None:
                continue
            uri = steps.object(step, report["name"]).uri
            where = (f"rank {rank} could not read bytes {report['start']}-{report['start'] + report['length'] - 1} "
                     f"of {uri} for the broadcast restore of step {step}")
            if report["missing"]:
                raise Gone(f"step {step} in {steps.directory} is committed but its object {report['name']} is "
                           f"missing ({where})")
            if rank == self.rank and error is not None:
                add_note(error, where)
                raise error
            raise (CheckpointCorruptError if report["damaged"] else CheckpointError)(f"{where}: {report['error']}")
        return sum(block.length for block in blocks)

    def _send_all(self, copy: StepStore, step: int, blocks: list[_Block], within: Any) -> None:
        """Broadcast each of ``blocks`` from the rank that read it to the others of ``within`` (a subgroup, None:
        every rank), in order, through one buffer."""
        if not blocks:
            return
        torch = self._torch
        host = torch.empty(BLOCK, dtype=torch.uint8)
        wire = host if self._device.type == "cpu" else torch.empty(BLOCK, dtype=torch.uint8, device=self._device)
        view = host.numpy()
        files: dict[str, int] = {}
        try:
            for block in blocks:
                fd = files.get(block.name)
                if fd is None:
                    fd = files[block.name] = os.open(copy.object(step, block.name).path, os.O_RDWR | os.O_CLOEXEC)
                length = block.length
                if block.owner == self.rank:
                    os.preadv(fd, [memoryview(view)[:length]], block.start)
                    if wire is not host:
                        wire[:length].copy_(host[:length])
                what = f"bytes {block.start}-{block.start + length - 1} of {block.name} from rank {block.owner}"
                self._group.send(wire[:length], block.owner, what, within)
                if block.owner != self.rank:
                    if wire is not host:
                        host[:length].copy_(wire[:length])
                    os.pwrite(fd, memoryview(view)[:length], block.start)
        finally:
            for fd in files.values():
                os.close(fd)

@contextmanager
def shared_reads(broadcast: bool, timeout: float) -> Iterator[Exchange | None]:
    """An :class:`Exchange` (each collective waiting at most ``timeout`` seconds) for the block when ``broadcast``
    and a process group of more than one rank is initialized; else None (each rank reads for itself), with an
    INFO line saying why when ``broadcast`` was asked for. The copies it made are removed when the block exits."""
    group = TorchGroup.of_initialized(timeout, "a broadcast restore") if broadcast else None
    if broadcast and (group is None or group.world < 2):
        _log.logger.info("restore(broadcast=True) without a torch.distributed process group of several ranks: "
                         "this rank reads the step itself")
    if group is None or group.world < 2:
        yield None
        return
    exchange = Exchange(group)
    try:
        yield exchange
    finally:
        exchange.close()


class _Copy(StepStore):
    """The step store of a local copy of one step's objects, named in messages as the store it copies."""

    def __init__(self, root: Path, of: StepStore) -> None:
        super().__init__(Location(str(root)), InUse(("file", str(root))), of.kinds)
        self._of = of

    @property
    def directory(self) -> str:
        return self._of.directory


def _wanted(context: StepContext, kind: StepKind, step: int, manifest: StepManifest) -> dict[str, int] | None:
    """The objects of ``step``'s folder (name: size) this rank's restore of it reads: what the kind's ``reads``
    says (a sharded step: this rank's shard), else every object the step names; None when it names chunks of the
    chunk store too. A size the manifest lacks is asked of the store."""
    reads = getattr(kind, "reads", None)
    named = reads(context, step, manifest) if reads is not None else kind.objects(context.steps, step, manifest)
    if named.chunks:
        return None
    sizes = {}
    for name, size in named.files.items():
        found = size if size is not None else context.steps.object(step, name).size()
        if found is None:
            raise Gone(f"step {step} in {context.steps.directory} is committed but its object {name} is missing")
        sizes[name] = found
    return sizes


def _sharing(everyone: list[Any]) -> list[tuple[list[int], list[str]]]:
    """The objects read by more than one rank, from what each rank said it reads (``[directory, step, save id,
    {name: size}]``, or None): ``(ranks, names)`` for each set of ranks that read the same objects (the same step
    of the same directory, by name, with the same size), in one order. The same answer on every rank."""
    readers: dict[str, list[int]] = {}
    for rank, theirs in enumerate(everyone):
        if theirs is not None:
            for name, size in theirs[3].items():
                readers.setdefault(json.dumps([*theirs[:3], name, size]), []).append(rank)
    together: dict[tuple[int, ...], list[str]] = {}
    for key, ranks in sorted(readers.items()):
        if len(ranks) > 1:
            together.setdefault(tuple(ranks), []).append(json.loads(key)[3])
    return [(list(ranks), names) for ranks, names in sorted(together.items())]


def _deal(names: list[str], sizes: dict[str, int], owners: list[int]) -> list[_Block]:
    """The :data:`BLOCK` ranges of ``names`` in order, each dealt to the one of ``owners`` (ranks) that has the
    fewest bytes so far, the first such: a step of many small files is shared by bytes, not by count."""
    blocks: list[_Block] = []
    load = [0] * len(owners)
    for name in names:
        for start in range(0, sizes[name], BLOCK):
            length = min(BLOCK, sizes[name] - start)
            least = load.index(min(load))
            load[least] += length
            blocks.append(_Block(name, start, length, owners[least]))
    return blocks
