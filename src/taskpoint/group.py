"""One way for the ranks of a job to agree: a group's all-gather, broadcast and barrier (as DCP routes every
collective through one small wrapper, ``_DistWrapper``), in two implementations:

- :class:`TorchGroup`, on the default ``torch.distributed`` process group when one is initialized (torch is
  never imported here). Values are JSON, sent as bytes (the lengths, then the bytes padded to the longest). A
  wait that ends is a TimeoutError naming this rank and what it waited for, or a CheckpointError when the
  group failed sooner (a rank gone).
- :class:`StorageGroup`, through records in a folder otherwise. Rank k's part of the collective ``name`` is
  the group record ``{name}-{k}.json`` (:class:`Record`, docs/format.md): a record of another round (a
  previous launch's), of another rank, or unreadable, is absent. A rank whose newest record names this host
  and a process that no longer exists is gone; one on another host is known gone only by its silence.

Every wait of ranks on one another through storage is :func:`poll`, the one polling loop: pauses growing from
:data:`POLL_FIRST` to :data:`POLL_LONGEST`, an INFO line every :data:`SAY_EVERY` seconds, and
:class:`RanksMissing` at its bound or as soon as a rank it waits for is known gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ._log import logger, safe_uri
from .errors import CheckpointError, NewerFormatError
from .format.documents import GROUP_FORMAT, read_small_document, small_document
from .ranks import Ranks
from .storage import Location
from .workspace import process_alive

T = TypeVar("T")

#: The first and the longest pause between two looks at what the other ranks wrote (seconds).
POLL_FIRST, POLL_LONGEST = 0.05, 1.0
#: How often a wait on other ranks says that it still waits (seconds).
SAY_EVERY = 10.0


class RanksMissing(TimeoutError):
    """A wait on other ranks ended without them: ``missing`` did not answer within ``waited`` seconds, or the
    processes of ``gone`` (some of them) ended."""

    def __init__(self, what: str, missing: list[int], gone: list[int], waited: float) -> None:
        why = f"the processes of ranks {gone} are gone" if gone else f"no answer within {waited:.1f} s"
        super().__init__(f"{what}: ranks {missing} missing ({why})")
        self.missing, self.gone, self.waited = missing, gone, waited


def poll(what: str, check: Callable[[], T | None], timeout: float | None, *,
         missing: Callable[[], list[int]] = list, gone: Callable[[], set[int]] | None = None,
         pauses: tuple[float, float] = (POLL_FIRST, POLL_LONGEST),
         say: Callable[[float], None] | None = None) -> T:
    """What ``check`` returns once it is not None: the one polling loop of rank coordination, its pauses growing
    by half within ``pauses``. :class:`RanksMissing` (naming the ranks ``missing()`` lists) once ``timeout``
    seconds passed, or at once when one of them is ``gone()``. ``timeout`` None is a watch, not a wait: it ends
    only when ``check`` says so. Every :data:`SAY_EVERY` seconds the wait says that it still waits: ``say(waited
    seconds)`` where the caller knows better what it waits for, else a line naming the missing ranks (a watch
    says nothing)."""
    began = said = time.monotonic()
    deadline = math.inf if timeout is None else began + timeout
    pause, longest = pauses
    while (found := check()) is None:
        now = time.monotonic()
        lost = sorted(set(missing()) & gone()) if gone is not None else []
        if lost or now >= deadline:
            raise RanksMissing(what, missing(), lost, now - began)
        if (say is not None or timeout is not None) and now - said >= SAY_EVERY:
            said = now
            if say is not None:
                say(now - began)
            else:
                logger.info("%s: still waiting after %.0f s (at most %.0f s) for ranks %s", what, now - began,
                            timeout, missing())
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 1.5, longest)
    return found


@dataclasses.dataclass(frozen=True)
class Record:
    """Rank ``rank``'s part of one collective through storage: ``value``, in ``round`` (docs/format.md)."""

    round: str
    rank: int
    world_size: int
    host: str
    pid: int
    at: float
    value: Any

    def to_bytes(self) -> bytes:
        return small_document(GROUP_FORMAT, dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_bytes(cls, data: bytes | None) -> Record | None:
        """The record ``data`` holds; None when it is absent, not JSON, not a group record (of a version this
        taskpoint reads: one of a newer taskpoint is another launch's, as one of another round is)."""
        try:
            record = cls(**read_small_document(data, GROUP_FORMAT))
        except (ValueError, TypeError, NewerFormatError):
            return None
        typed = isinstance(record.round, str) and all(isinstance(n, int) for n in (record.rank, record.pid))
        return record if typed else None

    def alive(self) -> bool:
        """Whether the process that wrote it may still run: it is on another host, or it exists on this one."""
        return self.host != socket.gethostname() or self.pid <= 0 or process_alive(self.pid)


class StorageGroup:
    """The collectives of ``ranks`` through records in ``folder``, each waiting at most ``timeout`` seconds, each
    named by the caller (one name, one collective: a record is overwritten only by the next launch's).
    ``round_`` is the same on every rank of one launch and new with every launch; ``accept`` tells, of a record
    of this round, whether it counts (default: all do)."""

    def __init__(self, folder: Location, ranks: Ranks, round_: str, timeout: float,
                 accept: Callable[[Record], bool] | None = None) -> None:
        self.folder, self.ranks, self.round, self.timeout = folder, ranks, round_, timeout
        self._accept = accept
        #: The newest record read of each rank (kept after the records are removed: :meth:`gone` reads it).
        self._peers: dict[int, Record] = {}

    def publish(self, name: str, value: Any, round_: str | None = None) -> None:
        """Write this rank's record of collective ``name`` (of ``round_``, by default the group's)."""
        record = Record(self.round if round_ is None else round_, self.ranks.rank, self.ranks.world_size,
                        socket.gethostname(), os.getpid(), time.time(), value)
        self.folder.child(f"{name}-{self.ranks.rank}.json").write_small(record.to_bytes(),
                                                                         action=f"write the {name} record at")

    def read(self, name: str, rank: int) -> Record | None:
        """Rank ``rank``'s record of collective ``name``, of whatever round (None: none readable)."""
        record = Record.from_bytes(self.folder.child(f"{name}-{rank}.json").read_small())
        return record if record is not None and record.rank == rank else None

    def records(self, name: str) -> dict[int, Record]:
        """The records of collective ``name`` of this round, by rank, from one listing. Each is read again on
        every call: a rewrite within a second (the resolution of some stores' times) may leave its time as was."""
        listed = set(self.folder.list_names())
        found = {rank: record for rank in range(self.ranks.world_size) if f"{name}-{rank}.json" in listed
                 and (record := self.read(name, rank)) is not None and record.round == self.round
                 and (self._accept is None or self._accept(record))}
        self._peers.update(found)
        return found

    def gone(self) -> set[int]:
        """The other ranks whose newest record read names this host and a process that no longer exists."""
        return {rank for rank, record in self._peers.items() if rank != self.ranks.rank and not record.alive()}

    def forget(self, name: str) -> None:
        """Remove every rank's record of collective ``name`` (best effort: one left is of an old round to later
        readers)."""
        for rank in range(self.ranks.world_size):
            with contextlib.suppress(Exception):
                self.folder.child(f"{name}-{rank}.json").remove()

    def wait_for(self, name: str, ranks: Iterable[int], what: str, timeout: float | None = None) -> dict[int, Record]:
        """The records of collective ``name`` of ``ranks`` once all are there, waiting at most ``timeout`` (default
        the group's) through :func:`poll`."""
        wanted, held = sorted(ranks), dict[int, Record]()

        def check() -> dict[int, Record] | None:
            held.clear()
            held.update((rank, record) for rank, record in self.records(name).items() if rank in wanted)
            return dict(held) if len(held) == len(wanted) else None

        return poll(f"rank {self.ranks.rank} of {self.ranks.world_size}: {what} at {safe_uri(self.folder.uri)}",
                    check, self.timeout if timeout is None else timeout,
                    missing=lambda: [rank for rank in wanted if rank not in held], gone=self.gone)

    def all_gather(self, value: Any, name: str) -> list[Any]:
        """Every rank's ``value``, by rank."""
        self.publish(name, value)
        found = self.wait_for(name, range(self.ranks.world_size), f"waiting for every rank's {name}")
        return [found[rank].value for rank in range(self.ranks.world_size)]

    def broadcast(self, value: Any, name: str, src: int = 0) -> Any:
        """Rank ``src``'s ``value``, on every rank."""
        if self.ranks.rank == src:
            self.publish(name, value)
            return value
        return self.wait_for(name, [src], f"waiting for rank {src}'s {name}")[src].value

    def barrier(self, name: str) -> None:
        """Return once every rank reached the barrier ``name``."""
        self.all_gather(None, name)


class TorchGroup:
    """The collectives on the default ``torch.distributed`` process group, for ``purpose`` (named in the errors
    of its waits), each waiting at most ``timeout`` seconds (None: the process group's own timeout)."""

    def __init__(self, dist: Any, timeout: float | None, purpose: str) -> None:
        self._dist, self.torch = dist, sys.modules["torch"]
        self.rank, self.world = int(dist.get_rank()), int(dist.get_world_size())
        self._timeout, self._purpose = timeout, purpose
        self.device = self.torch.device("cuda", self.torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else self.torch.device("cpu")

    @classmethod
    def of_initialized(cls, timeout: float | None, purpose: str) -> TorchGroup | None:
        """The group on the default process group when ``torch.distributed`` is imported and that group is
        initialized; else None (never imports torch: a program that uses it has imported it)."""
        dist = sys.modules.get("torch.distributed")
        return cls(dist, timeout, purpose) if dist is not None and dist.is_available() and dist.is_initialized() \
            else None

    def wait(self, work: Any, what: str, timeout: float | None = None) -> None:
        """Wait for the collective ``work`` at most ``timeout`` (default the group's): TimeoutError naming this
        rank and ``what`` after it, and CheckpointError when the group fails sooner (a rank gone)."""
        limit = self._timeout if timeout is None else timeout
        try:
            work.wait() if limit is None else work.wait(timeout=datetime.timedelta(seconds=limit))
        except RuntimeError as exc:
            timed_out = "timed out" in str(exc).lower()
            raise (TimeoutError if timed_out else CheckpointError)(
                f"rank {self.rank} of {self.world} gave up waiting for {what} in {self._purpose} "
                f"({'after ' + format(limit, 'g') + ' s' if timed_out and limit else 'the process group failed'}: "
                f"{exc}); every rank must call it for the same step together") from exc

    def send(self, tensor: Any, src: int, what: str, within: Any = None) -> None:
        """Broadcast ``tensor`` (on :attr:`device`) from rank ``src`` into every rank's ``tensor``: the ranks of
        ``within`` (a group of :meth:`subgroup`; None: every rank)."""
        self.wait(self._dist.broadcast(tensor, src=src, group=within, async_op=True), what)

    def subgroup(self, ranks: list[int]) -> Any:
        """A process group of ``ranks`` (sorted) for :meth:`send`; None when they are every rank (the default
        group). Every rank makes each subgroup, in the same order, also those it is not in (torch's rule)."""
        if len(ranks) == self.world:
            return None
        limit = None if self._timeout is None else datetime.timedelta(seconds=self._timeout)
        return self._dist.new_group(ranks, timeout=limit)

    def start_max(self, value: int, name: str) -> Callable[[float | None], int]:
        """Start an all-reduce of one int (the largest) without waiting for it; the function it returns waits for
        it (at most the seconds it is given, None: the group's timeout) and gives the result. An all-reduce, not
        an all-gather: a process that ends with a gloo all-gather in flight aborts (SIGABRT, torch 2.13), one
        with an all-reduce in flight ends as it should."""
        mine = self.torch.tensor([value], dtype=self.torch.int64, device=self.device)
        work = self._dist.all_reduce(mine, op=self._dist.ReduceOp.MAX, async_op=True)

        def result(timeout: float | None) -> int:
            self.wait(work, name, timeout)
            return int(mine.item())
        return result

    def all_gather(self, value: Any, name: str) -> list[Any]:
        """Every rank's ``value`` (JSON), by rank; ``name`` says what it is in the errors of the wait."""
        torch, data = self.torch, json.dumps(value).encode()
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = [torch.zeros_like(length) for _ in range(self.world)]
        self.wait(self._dist.all_gather(lengths, length, async_op=True), name)
        sizes = [int(each.item()) for each in lengths]
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(self.device)
        theirs = [torch.empty_like(mine) for _ in range(self.world)]
        self.wait(self._dist.all_gather(theirs, mine, async_op=True), name)
        return [json.loads(bytes(each.cpu().numpy()[:size])) for each, size in zip(theirs, sizes, strict=True)]

    def broadcast(self, value: Any, name: str, src: int = 0) -> Any:
        """Rank ``src``'s ``value``, on every rank."""
        return self.all_gather(value if self.rank == src else None, name)[src]

    def barrier(self, name: str) -> None:
        """Return once every rank reached the barrier ``name``."""
        self.all_gather(None, name)


#: The one way for ranks to agree: the protocols built on it call all_gather, broadcast and barrier.
Group = TorchGroup | StorageGroup
