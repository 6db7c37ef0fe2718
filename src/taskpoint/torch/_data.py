"""The position of a ``DataLoader`` inside its epoch, saved so that the next batch after a resume is the batch
the interrupted run would have drawn.

A ``RandomSampler`` draws its epoch's permutation when its iteration starts: from its ``generator``, or, when
it has none, from a seed it draws from torch's global generator; a ``DistributedSampler`` from ``seed + epoch``.
:class:`SamplerPosition` sits between the loader's ``BatchSampler`` and the sampler: when an epoch starts it
records what the permutation is drawn from (the global generator's state, the sampler's generator's state, its
epoch and seed), and it counts the indices handed out. A resume sets those back, draws the same permutation,
skips what was handed out, and puts torch's global generator back where the training left it (starting the
loader's iteration draws a seed from it for the workers, a draw the interrupted run made at the epoch's start).
A resume at an epoch's end runs that epoch's iteration out at once instead: a ``RandomSampler`` draws once more
from its generator when its iteration ends, and the next epoch draws from where that left it.

The count is exact only when the loader fetches a batch when the loop asks for it: ``num_workers=0``. Workers
prefetch ahead of the loop; torchdata's ``StatefulDataLoader`` (``data=`` takes it) tracks them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from ._match import Apply, Mismatches

#: The samplers whose order depends only on torch's generators, their epoch and their seed.
SAMPLERS = (RandomSampler, DistributedSampler, SequentialSampler)


class SamplerPosition:
    """Installed as ``loader.batch_sampler.sampler`` (see the module): the sampler it wraps, and where the
    current epoch of it stands."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        batches = loader.batch_sampler
        if loader.num_workers:
            raise ValueError(f"TrainState(data=...): this DataLoader has num_workers={loader.num_workers}, whose "
                             "workers fetch batches ahead of the loop, so the batches the loop consumed are not "
                             "known. Use num_workers=0, or torchdata's StatefulDataLoader (data= takes it).")
        if type(batches) is not BatchSampler:
            raise TypeError("TrainState(data=...) follows a DataLoader that batches with torch's BatchSampler "
                            f"(batch_size=N), not {type(batches).__name__}; give data= an object with "
                            "state_dict()/load_state_dict() (torchdata's StatefulDataLoader) instead")
        sampler = batches.sampler
        if not isinstance(sampler, SAMPLERS):
            raise TypeError(f"TrainState(data=...): the DataLoader's sampler is a {type(sampler).__name__}; "
                            "its position is followed for RandomSampler, DistributedSampler and "
                            "SequentialSampler (or give data= an object with state_dict()/load_state_dict())")
        self.sampler = sampler
        self.batch_size = batches.batch_size
        self.batches = len(batches)
        self._start: dict[str, Any] | None = None
        self._taken = 0
        self._pending: tuple[dict[str, Any], int] | None = None
        self._global_after: torch.Tensor | None = None
        batches.sampler = self

    @classmethod
    def of(cls, loader: DataLoader[Any]) -> SamplerPosition:
        """The loader's position, installed on first use (two TrainStates of one loader share it)."""
        current = loader.batch_sampler.sampler if isinstance(loader.batch_sampler, BatchSampler) else None
        return current if isinstance(current, SamplerPosition) else cls(loader)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        """The sampler's indices, counted; after a restore, the rest of the interrupted epoch."""
        pending, self._pending = self._pending, None
        if pending is None:
            self._start, self._taken = self._capture(), 0
            inner = iter(self.sampler)
        else:
            start, taken = pending
            inner = self._replay(start, taken, self._global_after)
            self._start, self._taken, self._global_after = start, taken, None
        for index in inner:
            self._taken += 1
            yield index

    def _replay(self, start: dict[str, Any], taken: int | None, after: torch.Tensor | None) -> Iterator[int]:
        """The sampler's iteration of the epoch that began at ``start``, its first ``taken`` indices skipped (all
        when None: its generator then stands where the interrupted epoch left it); torch's global generator set
        to ``after`` (or left as it was) once the permutation is drawn."""
        after = after if after is not None else torch.get_rng_state()
        self._set(start)
        inner = iter(self.sampler)
        for _ in itertools.islice(inner, taken):
            pass
        torch.set_rng_state(after)
        return inner

    def _capture(self) -> dict[str, Any]:
        generator = getattr(self.sampler, "generator", None)
        return {"global": torch.get_rng_state(),
                "generator": generator.get_state() if isinstance(generator, torch.Generator) else None,
                "epoch": getattr(self.sampler, "epoch", None), "seed": getattr(self.sampler, "seed", None)}

    def _set(self, start: dict[str, Any]) -> None:
        torch.set_rng_state(start["global"])
        generator = getattr(self.sampler, "generator", None)
        if isinstance(generator, torch.Generator) and start["generator"] is not None:
            generator.set_state(start["generator"])
        if isinstance(self.sampler, DistributedSampler) and start["epoch"] is not None:
            self.sampler.set_epoch(start["epoch"])

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch started from, how many indices of it were handed out (``taken`` 0 and no
        start before the first epoch), and how many an epoch has (another data set shuffles otherwise)."""
        return {"taken": self._taken, "start": self._start, "length": len(self.sampler)}

    def plan(self, saved: Any, prefix: str, found: Mismatches, global_after: torch.Tensor | None) -> Apply | None:
        """Check a saved position (the sampler's seed must be the one saved); what restores it.
        ``global_after``: torch's global generator state to continue from after the epoch's permutation is
        drawn again (the one restored with it), else the state it has then."""
        if not isinstance(saved, dict) or not {"taken", "start", "length"} <= saved.keys():
            found.mismatched.append((prefix.rstrip("."), "the checkpoint holds no DataLoader position"))
            return None
        start = saved["start"]
        seed = getattr(self.sampler, "seed", None)
        if start is not None and start["seed"] != seed:
            found.mismatched.append((f"{prefix}seed", f"sampler seed {start['seed']} in the checkpoint vs {seed}"))
            return None
        if saved["length"] != len(self.sampler):  # another data set: another permutation
            found.mismatched.append((f"{prefix}length", f"{saved['length']} samples an epoch in the checkpoint vs "
                                                        f"{len(self.sampler)}"))
            return None

        def apply() -> None:
            taken = saved["taken"]
            consumed = taken if self.batch_size is None else math.ceil(taken / self.batch_size)
            self._start, self._taken, self._pending = start, taken, None
            if start is None or taken == 0:
                return
            if consumed < self.batches:
                self._pending, self._global_after = (start, taken), global_after
            else:  # a finished epoch: run it out, so that its generator is where the next epoch draws from
                for _ in self._replay(start, None, global_after):
                    pass

        return apply
