"""latest_checkpoint on a tree written by real PyTorch Lightning runs, after a copy that equalises mtimes."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path

import pytest

from helpers import LazyModule, requires
from taskpoint.latest import latest_checkpoint

pytestmark = [pytest.mark.slow, requires("lightning", "torch")]

L = LazyModule("lightning")
torch = LazyModule("torch")
models = LazyModule("_lightning_models")

SAME_MTIME = 1_700_000_000
STEPS_PER_EPOCH = 2


def train(root: Path, epochs: int) -> Path:
    """One Lightning run under ``root``; returns its ``version_N`` folder."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=generator)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8 // STEPS_PER_EPOCH
    )
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(save_top_k=-1, save_last=True, every_n_epochs=1)
    trainer = L.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=L.pytorch.loggers.CSVLogger(root),
        callbacks=[checkpoints],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(models.Regressor(), train_dataloaders=data)
    return Path(trainer.log_dir)


@pytest.fixture(scope="module")
def restored_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs in one root (the first longer), copied elsewhere with every mtime set equal."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    root = tmp_path_factory.mktemp("train")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = train(root, epochs=3)
        second = train(root, epochs=2)
    assert (first.name, second.name) == ("version_0", "version_1")

    restored = tmp_path_factory.mktemp("restored") / "tree"
    shutil.copytree(root, restored)
    for p in restored.rglob("*"):
        os.utime(p, (SAME_MTIME, SAME_MTIME))
    return restored


def test_lightning_tree_is_what_the_ranking_expects(restored_tree: Path) -> None:
    ckpts = restored_tree / "lightning_logs"
    assert sorted(p.name for p in (ckpts / "version_0/checkpoints").iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"
    ]
    assert sorted(p.name for p in (ckpts / "version_1/checkpoints").iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"
    ]
    assert len({p.stat().st_mtime_ns for p in restored_tree.rglob("*")}) == 1


def test_latest_is_last_ckpt_of_the_newest_version(restored_tree: Path) -> None:
    expected = restored_tree / "lightning_logs/version_1/checkpoints/last.ckpt"
    assert latest_checkpoint(restored_tree) == expected
    assert latest_checkpoint(restored_tree, "**/last.ckpt") == expected


def test_latest_epoch_file_is_highest_step_of_the_newest_version(restored_tree: Path) -> None:
    # version_0 ran longer (epoch=2-step=6), but version_1 is the later run.
    assert latest_checkpoint(restored_tree, "**/epoch=*.ckpt") == (
        restored_tree / "lightning_logs/version_1/checkpoints/epoch=1-step=4.ckpt"
    )


def test_latest_checkpoint_resumes_in_lightning(restored_tree: Path) -> None:
    """The file found is a real Lightning checkpoint of the later run, at its final step."""
    found = latest_checkpoint(restored_tree)
    assert found is not None
    state = torch.load(found, map_location="cpu", weights_only=False)
    assert (state["epoch"], state["global_step"]) == (1, 2 * STEPS_PER_EPOCH)


def test_older_run_with_newer_mtimes_still_loses(restored_tree: Path, tmp_path: Path) -> None:
    """Copy tools may leave any order of mtimes; the earlier run stays older whatever they say."""
    tree = tmp_path / "tree"
    shutil.copytree(restored_tree, tree)
    for p in (tree / "lightning_logs/version_0").rglob("*"):
        os.utime(p, (SAME_MTIME + 100, SAME_MTIME + 100))
    version_1 = tree / "lightning_logs/version_1/checkpoints"
    assert latest_checkpoint(tree) == version_1 / "last.ckpt"
    assert latest_checkpoint(tree, "**/epoch=*.ckpt") == version_1 / "epoch=1-step=4.ckpt"


def test_latest_checkpoint_after_a_round_trip_through_storage(restored_tree: Path, s3_store) -> None:
    """The Lightning tree saved through a Checkpoint to the S3 server and loaded back ranks the same."""
    from taskpoint import Checkpoint

    dest = s3_store.url("run", "1", "checkpoint")
    Checkpoint(dest, storage_options=s3_store.storage_options).save_sync(restored_tree)
    with Checkpoint(s3_store.url("run", "2", "checkpoint"), dest, storage_options=s3_store.storage_options) as cp:
        loaded = cp.load_sync()
        assert loaded is not None
        for p in loaded.rglob("*"):  # as after a copy: every mtime is "now"
            os.utime(p)
        version_1 = loaded / "lightning_logs" / "version_1" / "checkpoints"
        assert latest_checkpoint(loaded) == version_1 / "last.ckpt"
        assert latest_checkpoint(loaded, "**/epoch=*.ckpt") == version_1 / "epoch=1-step=4.ckpt"
