"""CheckpointManager.verify() of a step a newer taskpoint wrote: its own state, ``newer``, never ``damaged``."""

from __future__ import annotations

from pathlib import Path

import pytest

from _newer import damage, steps_with_a_newer_one
from taskpoint import CheckpointManager
from taskpoint.errors import NewerFormatError


def test_a_newer_step_is_its_own_state_and_the_others_verify(tmp_path: Path) -> None:
    root = steps_with_a_newer_one(tmp_path / "steps")
    damage(root, 3)
    with CheckpointManager(str(root), preemption=False) as manager:
        verification = manager.verify()
        states = {result.step: result.state for result in verification.steps}
        assert states == {1: "healthy", 2: "newer", 3: "damaged"}
        assert verification.newer == [2] and verification.damaged == [3] and not verification.healthy
        assert "upgrade taskpoint" in verification.steps[1].detail
        with pytest.raises(NewerFormatError, match="upgrade taskpoint"):
            manager.verify(2)


def test_a_listing_shows_a_newer_step_as_newer(tmp_path: Path) -> None:
    root = steps_with_a_newer_one(tmp_path / "steps")
    damage(root, 3)  # damage to the payload is for verify; the listing compares sizes only
    with CheckpointManager(str(root), preemption=False) as manager:
        summaries = {summary.step: summary for summary in manager.inventory()}
    assert [summaries[step].state for step in (1, 2, 3)] == ["committed", "newer", "committed"]
    assert "upgrade taskpoint" in (summaries[2].problem or "")
