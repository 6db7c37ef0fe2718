"""latest_checkpoint: the newest checkpoint by the progress in its name, never by copy-destroyed mtimes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from taskpoint.latest import latest_checkpoint

SAME_MTIME = 1_700_000_000


def make_tree(root: Path, entries: list[str], mtime: int | None = SAME_MTIME) -> None:
    """Create files (and folders, for entries ending in ``/``); give every one the same mtime."""
    for entry in entries:
        target = root / entry
        if entry.endswith("/"):
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(entry.encode())
    if mtime is not None:
        for p in root.rglob("*"):
            os.utime(p, (mtime, mtime))


CKPTS = "lightning_logs/version_0/checkpoints"

# (files in the tree, glob pattern, expected winner). Every file has the same mtime.
CASES = [
    # Lightning's names.
    pytest.param(["epoch=0-step=10.ckpt", "epoch=2-step=30.ckpt", "epoch=1-step=20.ckpt"], "**/*.ckpt",
                 "epoch=2-step=30.ckpt", id="epoch-step"),
    pytest.param(["epoch=9-step=90.ckpt", "epoch=10-step=100.ckpt"], "**/*.ckpt",
                 "epoch=10-step=100.ckpt", id="numeric-not-lexical"),
    pytest.param(["epoch=3-step=400-val_loss=0.12.ckpt", "epoch=2-step=300-val_loss=0.01.ckpt"], "**/*.ckpt",
                 "epoch=3-step=400-val_loss=0.12.ckpt", id="extra-metrics"),
    pytest.param(["step=5.ckpt", "step=50.ckpt", "step=9.ckpt"], "**/*.ckpt", "step=50.ckpt", id="step-only"),
    pytest.param(["epoch=2.ckpt", "epoch=10.ckpt", "epoch=9.ckpt"], "**/*.ckpt", "epoch=10.ckpt", id="epoch-only"),
    pytest.param(["epoch=1-step=90.ckpt", "epoch=2-step=100.ckpt"], "**/*.ckpt", "epoch=2-step=100.ckpt",
                 id="step-decides-before-epoch"),
    pytest.param(["sample-epoch03-step400.ckpt", "sample-epoch04-step500.ckpt"], "**/*.ckpt",
                 "sample-epoch04-step500.ckpt", id="no-metric-name-insert"),
    pytest.param(["train_step=999.ckpt", "step=5.ckpt"], "**/*.ckpt", "step=5.ckpt", id="train_step-is-not-step"),
    pytest.param(["model.ckpt", "epoch=0-step=1.ckpt"], "**/*.ckpt", "epoch=0-step=1.ckpt",
                 id="unnamed-progress-ranks-lowest"),
    # last.ckpt is the newest in its own folder.
    pytest.param(["epoch=5-step=50.ckpt", "last.ckpt", "epoch=4-step=40.ckpt"], "**/*.ckpt", "last.ckpt",
                 id="last-beats-siblings"),
    pytest.param(["last.ckpt"], "**/*.ckpt", "last.ckpt", id="last-alone"),
    pytest.param(["a/last.ckpt", "a/epoch=3-step=30.ckpt", "b/epoch=2-step=20.ckpt"], "**/*.ckpt",
                 "a/last.ckpt", id="last-carries-its-folder-progress"),
    pytest.param(["a/last.ckpt", "a/epoch=1-step=10.ckpt", "b/epoch=2-step=20.ckpt"], "**/*.ckpt",
                 "b/epoch=2-step=20.ckpt", id="last-only-newest-in-its-folder"),
    pytest.param(["a/last.ckpt", "a/epoch=5-step=50.ckpt", "b/last.ckpt", "b/epoch=1-step=10.ckpt"],
                 "**/last.ckpt", "a/last.ckpt", id="last-dated-by-unmatched-siblings"),
    # Lightning's -vN clash suffix: a later run writing into the same folder.
    pytest.param(["last.ckpt", "last-v1.ckpt", "epoch=4-step=50.ckpt", "epoch=2-step=30-v1.ckpt"], "**/*.ckpt",
                 "last-v1.ckpt", id="last-v1-beats-last"),
    pytest.param(["last-v2.ckpt", "last-v10.ckpt", "last.ckpt"], "**/*.ckpt", "last-v10.ckpt",
                 id="clash-suffix-numeric"),
    pytest.param(["epoch=1-step=10.ckpt", "epoch=1-step=10-v1.ckpt"], "**/*.ckpt", "epoch=1-step=10-v1.ckpt",
                 id="step-clash-suffix"),
    pytest.param(["epoch=1-step=10-v1.ckpt", "epoch=2-step=20.ckpt"], "**/*.ckpt", "epoch=2-step=20.ckpt",
                 id="clash-suffix-after-progress"),
    # version_N folders, numerically, before anything in the name.
    pytest.param(["lightning_logs/version_2/checkpoints/epoch=9-step=900.ckpt",
                  "lightning_logs/version_3/checkpoints/epoch=0-step=1.ckpt"], "**/*.ckpt",
                 "lightning_logs/version_3/checkpoints/epoch=0-step=1.ckpt", id="version-beats-step"),
    pytest.param(["lightning_logs/version_9/checkpoints/last.ckpt",
                  "lightning_logs/version_10/checkpoints/epoch=0-step=1.ckpt"], "**/*.ckpt",
                 "lightning_logs/version_10/checkpoints/epoch=0-step=1.ckpt", id="version_10-beats-version_9"),
    pytest.param(["lightning_logs/version_0/checkpoints/last.ckpt",
                  "lightning_logs/version_1/checkpoints/last.ckpt",
                  "lightning_logs/version_1/checkpoints/epoch=0-step=2.ckpt",
                  "lightning_logs/version_0/checkpoints/epoch=4-step=10.ckpt"], "**/last.ckpt",
                 "lightning_logs/version_1/checkpoints/last.ckpt", id="glob-last-only"),
    pytest.param(["lightning_logs/version_0/checkpoints/last.ckpt",
                  "lightning_logs/version_1/checkpoints/last.ckpt",
                  "lightning_logs/version_1/checkpoints/epoch=1-step=4.ckpt",
                  "lightning_logs/version_1/checkpoints/epoch=0-step=2.ckpt",
                  "lightning_logs/version_0/checkpoints/epoch=4-step=10.ckpt"], "**/epoch=*.ckpt",
                 "lightning_logs/version_1/checkpoints/epoch=1-step=4.ckpt", id="glob-epoch-files"),
    pytest.param(["other/epoch=99-step=9999.ckpt", f"{CKPTS}/epoch=0-step=1.ckpt"], "**/*.ckpt",
                 f"{CKPTS}/epoch=0-step=1.ckpt", id="unversioned-ranks-below-versioned"),
    pytest.param(["version_x/epoch=5-step=5.ckpt", "version_1a/epoch=1-step=1.ckpt", "v2/epoch=0-step=0.ckpt"],
                 "**/*.ckpt", "version_x/epoch=5-step=5.ckpt", id="only-exact-version_N-folders"),
    pytest.param(["exp/version_1/a/version_0/step=9.ckpt", "exp/version_1/b/version_2/step=1.ckpt",
                  "exp/version_0/b/version_7/step=99.ckpt"], "**/*.ckpt",
                 "exp/version_1/b/version_2/step=1.ckpt", id="nested-versions-outermost-first"),
    # Only files match.
    pytest.param(["epoch=9-step=99.ckpt/weights.bin", "last.ckpt/inner.bin", "epoch=1-step=1.ckpt"], "**/*.ckpt",
                 "epoch=1-step=1.ckpt", id="folders-named-ckpt-ignored"),
    # Other patterns.
    pytest.param(["a/step=9.pt", "b/step=7.pt", "c/epoch=9-step=99.ckpt"], "*/step=*.pt", "a/step=9.pt",
                 id="pattern-without-double-star"),
    pytest.param(["top.ckpt", "sub/epoch=5-step=5.ckpt"], "*.ckpt", "top.ckpt", id="pattern-top-level-only"),
    # Full ties: the same answer on every file system.
    pytest.param(["a/last.ckpt", "b/last.ckpt"], "**/*.ckpt", "b/last.ckpt", id="full-tie-deterministic"),
]


@pytest.mark.parametrize(("files", "pattern", "expected"), CASES)
def test_latest_checkpoint_with_identical_mtimes(
    tmp_path: Path, files: list[str], pattern: str, expected: str
) -> None:
    make_tree(tmp_path, files)
    assert latest_checkpoint(tmp_path, pattern) == tmp_path / expected


NAME_DECIDES = [case for case in CASES if case.id != "full-tie-deterministic"]


@pytest.mark.parametrize(("files", "pattern", "expected"), NAME_DECIDES)
def test_latest_checkpoint_ignores_mtime_that_points_elsewhere(
    tmp_path: Path, files: list[str], pattern: str, expected: str
) -> None:
    make_tree(tmp_path, files)
    # Make the expected winner the oldest file: the ranking must still pick it by name.
    for i, p in enumerate(sorted(tmp_path.rglob("*"))):
        os.utime(p, (SAME_MTIME + i + 1, SAME_MTIME + i + 1))
    os.utime(tmp_path / expected, (SAME_MTIME, SAME_MTIME))
    assert latest_checkpoint(tmp_path, pattern) == tmp_path / expected


def test_mtime_is_the_last_tie_break(tmp_path: Path) -> None:
    make_tree(tmp_path, ["a/model.ckpt", "b/model.ckpt", "c/epoch=0-step=0.ckpt"], mtime=None)
    os.utime(tmp_path / "a/model.ckpt", (SAME_MTIME + 10, SAME_MTIME + 10))
    os.utime(tmp_path / "b/model.ckpt", (SAME_MTIME, SAME_MTIME))
    os.utime(tmp_path / "c/epoch=0-step=0.ckpt", (SAME_MTIME - 10, SAME_MTIME - 10))
    assert latest_checkpoint(tmp_path) == tmp_path / "c/epoch=0-step=0.ckpt"
    assert latest_checkpoint(tmp_path, "**/model.ckpt") == tmp_path / "a/model.ckpt"


def test_same_folder_last_files_tie_break_on_mtime(tmp_path: Path) -> None:
    make_tree(tmp_path, ["a/last.ckpt", "b/last.ckpt"], mtime=None)
    os.utime(tmp_path / "a/last.ckpt", (SAME_MTIME + 1, SAME_MTIME + 1))
    os.utime(tmp_path / "b/last.ckpt", (SAME_MTIME, SAME_MTIME))
    assert latest_checkpoint(tmp_path) == tmp_path / "a/last.ckpt"


def test_missing_path_returns_none(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nope") is None


def test_empty_tree_returns_none(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None


def test_tree_without_matches_returns_none(tmp_path: Path) -> None:
    make_tree(tmp_path, ["a/weights.pt", "b.ckpt/", "c/last.ckpt/x"])
    assert latest_checkpoint(tmp_path) is None


def test_accepts_str_path(tmp_path: Path) -> None:
    make_tree(tmp_path, ["epoch=0-step=1.ckpt", "epoch=1-step=2.ckpt"])
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "epoch=1-step=2.ckpt"


def test_key_overrides_the_ranking(tmp_path: Path) -> None:
    make_tree(tmp_path, [f"{CKPTS}/last.ckpt", "lightning_logs/version_1/checkpoints/epoch=9-step=9.ckpt",
                         "old/huge.ckpt"])
    (tmp_path / "old/huge.ckpt").write_bytes(b"x" * 1000)
    assert latest_checkpoint(tmp_path, key=lambda p: p.stat().st_size) == tmp_path / "old/huge.ckpt"
    assert latest_checkpoint(tmp_path, key=lambda p: "version_0" in str(p)) == tmp_path / f"{CKPTS}/last.ckpt"


def test_key_ties_are_deterministic(tmp_path: Path) -> None:
    make_tree(tmp_path, ["a.ckpt", "c.ckpt", "b.ckpt"])
    assert latest_checkpoint(tmp_path, key=lambda p: 0) == tmp_path / "c.ckpt"


def test_key_is_not_called_without_matches(tmp_path: Path) -> None:
    def boom(p: Path) -> int:
        raise AssertionError("called")

    assert latest_checkpoint(tmp_path, key=boom) is None


@pytest.mark.parametrize(
    ("name", "pattern", "found"),
    [
        pytest.param("epoch=1-step=1.ckpt", "**/*.ckpt", True, id="double-star"),
        pytest.param("epoch=1-step=1.ckpt", "*.ckpt", True, id="top-level"),
        pytest.param("last.ckpt", "**/**/last.ckpt", True, id="double-double-star"),
        pytest.param("epoch=1-step=1.ckpt", "**/last.ckpt", False, id="other-name"),
        pytest.param("last.ckpt", "checkpoints/last.ckpt", False, id="needs-a-folder"),
        pytest.param("Last.CKPT", "**/*.ckpt", False, id="case-sensitive"),
    ],
)
def test_path_that_is_a_file_is_a_tree_of_one(tmp_path: Path, name: str, pattern: str, found: bool) -> None:
    file = tmp_path / name
    file.write_bytes(b"weights")
    assert latest_checkpoint(file, pattern) == (file if found else None)
