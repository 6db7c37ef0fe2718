"""``TrainState``'s data position and generators in one process: after a restore the loader hands out the rest of
the interrupted epoch, batch for batch, for each sampler it follows, and the generators draw what they would
have drawn. (tests/e2e/test_resume_exact.py checks whole runs across real processes and signals.)"""

from __future__ import annotations

import random
from typing import Any

import pytest

from helpers import LazyModule, requires
from taskpoint import CheckpointManager, RestoreMismatch

pytestmark = requires("torch", "numpy")

# Imported when a test first uses them: collecting this module imports no torch.
torch = LazyModule("torch")
np = LazyModule("numpy")
data = LazyModule("torch.utils.data")
tp_torch = LazyModule("taskpoint.torch")
LOADERS = ["shuffled", "shuffled, own generator", "shuffled, last batch dropped", "distributed"]


def loader_of(kind: str) -> Any:
    DataLoader, DistributedSampler = data.DataLoader, data.DistributedSampler
    DATA = torch.arange(40).float().unsqueeze(1)
    return {
        "shuffled": DataLoader(DATA, batch_size=3, shuffle=True),
        "shuffled, own generator": DataLoader(DATA, batch_size=4, shuffle=True,
                                              generator=torch.Generator().manual_seed(5)),
        "shuffled, last batch dropped": DataLoader(DATA, batch_size=6, shuffle=True, drop_last=True),
        "distributed": DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=2, rank=1,
                                                                                  seed=9)),
    }[kind]


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("where", ["mid-epoch", "at an epoch's end"])
def test_after_a_restore_the_loader_and_generators_go_on_as_the_interrupted_run(tmp_path, kind, where):
    torch.manual_seed(0)
    loader = loader_of(kind)
    state = tp_torch.TrainState(torch.nn.Linear(1, 1), None, data=loader)
    per_epoch = len(loader)
    stop = per_epoch + 2 if where == "mid-epoch" else 2 * per_epoch
    seen: list[tuple[list[float], tuple[float, float, float]]] = []
    with CheckpointManager(tmp_path / "steps", preemption=False) as mgr:
        for epoch in range(3):
            if isinstance(loader.sampler, data.DistributedSampler):
                loader.sampler.set_epoch(epoch)
            for batch in loader:
                seen.append((batch.flatten().tolist(), draws()))
                if len(seen) == stop:
                    mgr.save(state, stop)
        torch.manual_seed(123)  # another process's generators, until the restore
        random.seed(4)
        resumed_loader = loader_of(kind)
        assert tp_torch.TrainState(torch.nn.Linear(1, 1), None, data=resumed_loader).restore(mgr) == stop
    again: list[tuple[list[float], tuple[float, float, float]]] = []
    for epoch in range(stop // per_epoch, 3):
        if isinstance(resumed_loader.sampler, data.DistributedSampler):
            resumed_loader.sampler.set_epoch(epoch)
        again += [(batch.flatten().tolist(), draws()) for batch in resumed_loader]
    assert again == seen[stop:]


@pytest.mark.e2e("starts a save process")
def test_a_background_save_keeps_the_state_of_when_it_was_called(tmp_path):
    model = torch.nn.Linear(2, 1)
    progress = {"step": 1}
    state = tp_torch.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), extra=progress)
    with CheckpointManager(tmp_path / "steps", async_save=True, preemption=False) as mgr:
        mgr.save(state, 1, blocking=False)
        saved_weight = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        progress["step"] = 2
        mgr.wait_until_finished()
        assert state.restore(mgr) == 1
    assert torch.equal(model.weight, saved_weight) and progress == {"step": 1}


class Stateful:
    """Anything with state_dict()/load_state_dict(), as torchdata's StatefulDataLoader."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_data_with_its_own_state_dict_is_saved_through_it(tmp_path):
    data = Stateful()
    data.position = 17
    with CheckpointManager(tmp_path / "steps", preemption=False) as mgr:
        mgr.save(tp_torch.TrainState(torch.nn.Linear(1, 1), None, data=data, rng=False), 1)
        restored = Stateful()
        assert tp_torch.TrainState(torch.nn.Linear(1, 1), None, data=restored, rng=False).restore(mgr) == 1
    assert restored.position == 17


def test_a_loader_with_workers_is_refused_naming_the_way_out():
    loader = data.DataLoader(torch.zeros(4, 1), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match=r"num_workers=2.*StatefulDataLoader"):
        tp_torch.TrainState(torch.nn.Linear(1, 1), None, data=loader)


def test_numpy_and_torch_generators_given_are_restored(tmp_path):
    numpy_generator, torch_generator = np.random.default_rng(1), torch.Generator().manual_seed(2)
    state = tp_torch.TrainState(torch.nn.Linear(1, 1), None, rng=[numpy_generator, torch_generator])
    with CheckpointManager(tmp_path / "steps", preemption=False) as mgr:
        mgr.save(state, 1)
        expected = (numpy_generator.random(3).tolist(), torch.rand(3, generator=torch_generator).tolist())
        assert state.restore(mgr) == 1
    assert (numpy_generator.random(3).tolist(), torch.rand(3, generator=torch_generator).tolist()) == expected


def test_a_loader_over_another_data_set_or_seed_is_a_mismatch(tmp_path):
    def loader(size: int, seed: int) -> Any:
        samples = torch.zeros(size, 1)
        return data.DataLoader(samples, batch_size=2,
                               sampler=data.DistributedSampler(samples, num_replicas=1, rank=0, seed=seed))

    def state(of: Any) -> Any:
        return tp_torch.TrainState(torch.nn.Linear(1, 1), None, data=of)

    saved = loader(8, 0)
    saving = state(saved)
    next(iter(saved))  # mid-epoch
    with CheckpointManager(tmp_path / "steps", preemption=False) as mgr:
        mgr.save(saving, 1)
        with pytest.raises(RestoreMismatch, match=r"data\.length: 8 samples an epoch in the checkpoint vs 10"):
            state(loader(10, 0)).restore(mgr)
        with pytest.raises(RestoreMismatch, match=r"data\.seed: sampler seed 0 in the checkpoint vs 1"):
            state(loader(8, 1)).restore(mgr)
