"""Strict restores of torch state: a model with a layer added, one removed, or one of another shape raises
RestoreMismatch naming them, with the target untouched; ``strict=False`` restores what matches and reports the
rest. Through ``tp_torch.load_state_dict_sync(manager, into=model)`` and ``TrainState.restore``, on local disk (what is
checked is the state dict, not the store)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest

from helpers import LazyModule, requires
from taskpoint import CheckpointManager, RestoreMismatch, RestoreReport
from taskpoint.errors import NAMES_SHOWN

pytestmark = requires("torch")

# Imported when a test first uses them: collecting this module imports no torch.
torch = LazyModule("torch")
tp_torch = LazyModule("taskpoint.torch")


def net(*widths: int) -> torch.nn.Sequential:
    torch.manual_seed(len(widths))
    return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)))


SAVED = (4, 8, 2)  # layers "0" (8x4) and "1" (2x8)
CHANGES: dict[str, tuple[tuple[int, ...], RestoreReport]] = {
    "a layer added": ((4, 8, 2, 3), RestoreReport(7, missing=("2.weight", "2.bias"))),
    "a layer removed": ((4, 8), RestoreReport(7, unexpected=("1.weight", "1.bias"))),
    "a layer of another shape": ((4, 16, 2), RestoreReport(7, mismatched=(
        ("0.weight", "shape (8, 4) in the checkpoint vs (16, 4) in the target"),
        ("0.bias", "shape (8,) in the checkpoint vs (16,) in the target"),
        ("1.weight", "shape (2, 8) in the checkpoint vs (2, 16) in the target")))),
}


def copy_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture
def manager(tmp_path):
    with CheckpointManager(tmp_path / "steps", preemption=False) as mgr:
        mgr.save(tp_torch.StateDict(net(*SAVED).state_dict()), 7)
        yield mgr


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_model_that_does_not_match_raises_naming_the_layers_and_is_left_untouched(manager, change):
    widths, report = CHANGES[change]
    model = net(*widths)
    before = copy_of(model)
    with pytest.raises(RestoreMismatch) as info:
        tp_torch.load_state_dict_sync(manager, into=model)
    assert info.value.report == report
    for line in report.problems():
        assert line in str(info.value)
    assert f"(step 7 in {manager.directory} does not match the target's structure" in str(info.value)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


@pytest.mark.parametrize("change", list(CHANGES))
def test_strict_false_restores_what_matches_and_reports_the_rest(manager, change):
    widths, report = CHANGES[change]
    model, saved = net(*widths), net(*SAVED).state_dict()
    before = copy_of(model)
    assert tp_torch.load_state_dict_sync(manager, into=model, strict=False) == report
    mismatched = {name for name, _ in report.mismatched} | set(report.missing)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name] if name in mismatched else saved[name]), name


def test_a_model_that_matches_is_restored_and_the_step_returned(manager):
    model = net(4, 8, 2)
    torch.nn.init.zeros_(model[0].weight)
    assert tp_torch.load_state_dict_sync(manager, into=model) == 7
    assert torch.equal(model[0].weight, net(*SAVED)[0].weight)
    assert tp_torch.load_state_dict_sync(manager, into=model, strict=False) == RestoreReport(7)
    with pytest.raises(TypeError, match="with into= restore a chosen step"):
        tp_torch.load_state_dict_sync(manager, into=model, fallback=True)


def test_another_dtype_is_a_mismatch_not_a_silent_cast(manager):
    model = net(4, 8, 2).double()
    with pytest.raises(RestoreMismatch, match=re.escape("0.weight: dtype torch.float32 in the checkpoint vs "
                                                        "torch.float64 in the target")):
        tp_torch.load_state_dict_sync(manager, into=model)


def test_the_message_names_the_first_few_and_how_many(tmp_path):
    wide = torch.nn.ModuleDict({f"layer{n}": torch.nn.Linear(2, 2) for n in range(6)})
    with CheckpointManager(tmp_path / "steps", preemption=False) as mgr:
        mgr.save(tp_torch.StateDict(torch.nn.Linear(2, 2).state_dict()), 1)
        with pytest.raises(RestoreMismatch) as info:
            tp_torch.load_state_dict_sync(mgr, into=wide)
    message = str(info.value)
    assert len(info.value.report.missing) == 12 and len(info.value.report.unexpected) == 2
    assert f"and {14 - NAMES_SHOWN} more" in message
    assert "12 missing from the checkpoint, 2 not in the target" in message
    assert "layer0.weight: the target has this" in message and "layer5.bias" not in message


def train_state(widths: tuple[int, ...], **parts: object) -> Any:
    model = net(*widths)
    return tp_torch.TrainState(model, torch.optim.Adam(model.parameters()), **parts)


def one_step(state: Any) -> None:
    model, optimizer = state.models[""], state.optimizers[""]
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_train_state_that_does_not_match_raises_and_changes_nothing(tmp_path, change):
    saved = train_state(SAVED)
    one_step(saved)
    widths, _ = CHANGES[change]
    target = train_state(widths)
    one_step(target)
    before, optimizer_before = copy_of(target.models[""]), target.optimizers[""].state_dict()
    with CheckpointManager(tmp_path / "steps", preemption=False) as mgr:
        mgr.save(saved, 3)
        with pytest.raises(RestoreMismatch) as info:
            target.restore(mgr)
        report = target.restore(mgr, strict=False)
    assert report is not None and not report.complete and report == info.value.report
    names = {*report.missing, *report.unexpected, *(name for name, _ in report.mismatched)}
    assert {n.removeprefix("model.") for n in names if n.startswith("model.")} == {
        *CHANGES[change][1].missing, *CHANGES[change][1].unexpected, *(n for n, _ in CHANGES[change][1].mismatched)}
    assert any(n.startswith("optimizer.") for n in names)  # its groups or state no longer fit: not restored
    assert str(target.optimizers[""].state_dict()) == str(optimizer_before)
    for name, value in target.models[""].state_dict().items():
        expected = saved.models[""].state_dict().get(name) if f"model.{name}" not in names else before[name]
        assert torch.equal(value, expected), name


def test_train_state_parts_missing_or_unexpected_are_named(tmp_path):
    saved = train_state(SAVED, extra={"step": 3})
    with CheckpointManager(tmp_path / "steps", preemption=False) as mgr:
        mgr.save(saved, 3)
        scheduled = train_state(SAVED, rng=False)
        scheduled_lr = torch.optim.lr_scheduler.StepLR(scheduled.optimizers[""], step_size=1)
        target = tp_torch.TrainState(scheduled.models[""], scheduled.optimizers[""], scheduler=scheduled_lr, rng=False)
        with pytest.raises(RestoreMismatch) as info:
            target.restore(mgr)
    assert info.value.report.missing == ("scheduler",)
    assert set(info.value.report.unexpected) == {"rng", "extra"}


@pytest.mark.parametrize("bad", [lambda: tp_torch.TrainState(torch.nn.Linear(1, 1), object()),
                                 lambda: tp_torch.TrainState("model", None),
                                 lambda: tp_torch.TrainState(torch.nn.Linear(1, 1), None, data=[1, 2])])
def test_train_state_refuses_what_it_cannot_save(bad: Callable[[], object]):
    with pytest.raises(TypeError, match=r"TrainState\("):
        bad()
