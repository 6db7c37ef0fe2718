"""taskpoint.lightning with real Lightning, on local disk and on the S3 server (moto).

In this process: ModelCheckpoint's top-k, ``save_last`` and ``every_n_train_steps`` and
``trainer.save_checkpoint`` through the plug-in, resumed with ``ckpt_path="last"`` and an explicit path; a
flipped byte in a remote ``.ckpt``; Lightning's ``AsyncCheckpointIO`` around the plug-in. In forked children of
tests/_lightning_trials.py (real processes, real signals): examples/lightning_plugin.py killed with SIGKILL at
random moments and resumed, and stopped with SIGTERM mid-epoch (exit 143), resumed at the signalled step.

Lightning's own listings (``ModelCheckpoint.setup``) use fsspec's defaults, not the plug-in's options: the S3
tests give them the endpoint through ``AWS_ENDPOINT_URL``, as docs/guides/lightning.md tells users to.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest

import _zygote as zygote
from helpers import LazyModule, requires
from taskpoint import CheckpointCorruptError

pytestmark = [pytest.mark.slow, requires("lightning", "torch")]

L = LazyModule("lightning")
torch = LazyModule("torch")
tl = LazyModule("taskpoint.lightning")
models = LazyModule("_lightning_models")

TRIALS = Path(__file__).resolve().parents[1] / "_lightning_trials.py"
RECORD = ".taskpoint.json"
SIGKILL_TRIALS = 10


@dataclass
class Root:
    """Where a run writes (``default_root_dir``), the plug-in's options, and an fsspec view of it."""

    url: str
    options: dict[str, Any]
    fs: Any
    inner: str

    def names(self, folder: str = "checkpoints") -> set[str]:
        path = f"{self.inner}/{folder}" if folder else self.inner
        return {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False, refresh=True)}

    def join(self, *parts: str) -> str:
        return "/".join([self.url.rstrip("/"), *parts])


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Root]:
    if request.param == "local":
        yield Root(str(tmp_path / "run"), {}, fsspec.filesystem("file"), str(tmp_path / "run"))
        return
    server = request.getfixturevalue("s3_server")
    location = server.new_location()
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)  # for Lightning's own fsspec instances
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **location.storage_options)
    yield Root(location.base, dict(location.storage_options), fs, location.base.removeprefix("s3://"))


def fit(root: Root, max_steps: int, ckpt_path: str | None = None, *, wrap_async: bool = False,
        model: Any = None, callbacks: tuple[Any, ...] = (), save_last: bool = True,
        warned: list[str] | None = None) -> tuple[Any, Any]:
    """Train ``max_steps`` with the plug-in, a checkpoint every 3 steps (``warned``: collects the warnings)."""
    torch.manual_seed(0)
    x = torch.randn(40, 4)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    io = tl.CheckpointIO(storage_options=root.options)
    started = models.StartedAt()
    trainer = L.Trainer(
        default_root_dir=root.url, max_steps=max_steps, logger=False, accelerator="cpu", devices=1,
        plugins=[L.pytorch.plugins.io.AsyncCheckpointIO(io) if wrap_async else io],
        callbacks=[started, *callbacks, L.pytorch.callbacks.ModelCheckpoint(
            every_n_train_steps=3, save_top_k=2, monitor="step", mode="max", save_last=save_last)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model or models.Regressor(), train_dataloaders=data, ckpt_path=ckpt_path)
    if warned is not None:
        warned.extend(str(w.message) for w in caught)
    return trainer, started


def assert_every_ckpt_has_its_record_and_nothing_else(root: Root) -> set[str]:
    names = root.names()
    ckpts = {n for n in names if n.endswith(".ckpt")}
    assert names == ckpts | {n + RECORD for n in ckpts}, names
    return ckpts


def test_top_k_last_and_every_n_steps_round_trip(root: Root) -> None:
    trainer, started = fit(root, max_steps=9)
    assert started.step == 0
    # every_n_train_steps=3, top 2 by step: 6 and 9 stay, 3 was removed with its record; last.ckpt of step 9
    assert assert_every_ckpt_has_its_record_and_nothing_else(root) == {
        "epoch=0-step=6.ckpt", "epoch=0-step=9.ckpt", "last.ckpt"}
    io = tl.CheckpointIO(storage_options=root.options)
    for name, step in [("epoch=0-step=6.ckpt", 6), ("epoch=0-step=9.ckpt", 9), ("last.ckpt", 9)]:
        assert io.load_checkpoint(root.join("checkpoints", name))["global_step"] == step
    trainer.save_checkpoint(root.join("manual.ckpt"))
    assert root.names("") >= {"manual.ckpt", "manual.ckpt" + RECORD}
    assert io.load_checkpoint(root.join("manual.ckpt"))["global_step"] == 9

    # "last": found through the plug-in's options, resumed at step 9 with the weights it saved
    resumed, started = fit(root, max_steps=15, ckpt_path="last")
    assert resumed.ckpt_path == root.join("checkpoints", "last.ckpt")
    assert started.step == 9
    saved = trainer.lightning_module.state_dict()
    assert all(torch.equal(started.weights[k], saved[k]) for k in saved)
    assert assert_every_ckpt_has_its_record_and_nothing_else(root) == {
        "epoch=1-step=12.ckpt", "epoch=1-step=15.ckpt", "last.ckpt"}

    # an explicit remote path resumes too
    explicit = root.join("checkpoints", "epoch=1-step=12.ckpt")
    again, started = fit(root, max_steps=13, ckpt_path=explicit)
    assert (again.ckpt_path, started.step) == (explicit, 12)


def test_last_with_nothing_saved_starts_from_scratch(root: Root) -> None:
    """A first run with ``save_last=True`` is told there is no last checkpoint yet and where it looked, not to set
    ``save_last=True`` (issue 40); without it, the hint to set it stays."""
    warned: list[str] = []
    trainer, started = fit(root, max_steps=2, ckpt_path="last", warned=warned)
    assert (trainer.ckpt_path, started.step) == (None, 0)
    [said] = [w for w in warned if "no last checkpoint" in w]
    assert "save_last" not in said and "looked for last*.ckpt in " in said and "none saved there yet" in said

    warned.clear()
    fit(Root(root.join("other"), root.options, root.fs, f"{root.inner}/other"), max_steps=2, ckpt_path="last",
        save_last=False, warned=warned)
    [said] = [w for w in warned if "no last checkpoint" in w]
    assert "HINT: Set `ModelCheckpoint(..., save_last=True)`." in said


@pytest.mark.parametrize("root", ["s3"], indirect=True)
def test_flipped_byte_in_a_remote_ckpt_raises_corrupt_error(root: Root) -> None:
    fit(root, max_steps=3)
    key = f"{root.inner}/checkpoints/last.ckpt"
    data = bytearray(root.fs.cat_file(key))
    data[len(data) // 2] ^= 0x01
    root.fs.pipe_file(key, bytes(data))
    with pytest.raises(CheckpointCorruptError):
        tl.CheckpointIO(storage_options=root.options).load_checkpoint(root.join("checkpoints", "last.ckpt"))
    with pytest.raises(CheckpointCorruptError):
        fit(root, max_steps=5, ckpt_path="last")


def test_async_checkpoint_io_around_the_plug_in(tmp_path: Path) -> None:
    root = Root(str(tmp_path / "run"), {}, fsspec.filesystem("file"), str(tmp_path / "run"))
    fit(root, max_steps=6, wrap_async=True)
    assert assert_every_ckpt_has_its_record_and_nothing_else(root) == {
        "epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"}
    resumed, started = fit(root, max_steps=8, ckpt_path="last", wrap_async=True)
    assert (resumed.ckpt_path, started.step) == (root.join("checkpoints", "last.ckpt"), 6)


def test_a_notice_after_the_last_batch_of_an_epoch_still_saves_and_exits_143(tmp_path: Path) -> None:
    """Lightning ends the fit at the epoch's end on SIGTERM, with status 0: the callback saves first."""
    from taskpoint import preemption

    class NoticeAfterTheCheck(L.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 10:  # the last of the epoch's 10 batches, after SaveOnPreemption's check
                preemption.notify()

    root = Root(str(tmp_path / "run"), {}, fsspec.filesystem("file"), str(tmp_path / "run"))
    try:
        with pytest.raises(SystemExit) as stopped:
            fit(root, max_steps=30, callbacks=(tl.SaveOnPreemption(), NoticeAfterTheCheck()))
    finally:
        preemption.clear()
        preemption.uninstall()
    assert stopped.value.code == 143
    last = root.join("checkpoints", "last.ckpt")
    assert tl.CheckpointIO().load_checkpoint(last)["global_step"] == 10
    resumed, started = fit(root, max_steps=12, ckpt_path="last")
    assert (resumed.ckpt_path, started.step) == (last, 10)


def test_a_sigterm_during_validation_saves_the_step_reached_and_exits_143(tmp_path: Path) -> None:
    """A real SIGTERM while a validation inside the fit runs: Lightning's evaluation loop would end the fit at once
    with status 0 (its SIGTERMException); the callback saves the step the training reached and exits 143."""
    import signal

    from taskpoint import preemption

    class SignalledWhileValidating(models.Regressor):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            if self.trainer.global_step == 5 and batch_idx == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

    torch.manual_seed(0)
    x = torch.randn(40, 4)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    run = tmp_path / "run"
    trainer = L.Trainer(default_root_dir=str(run), max_steps=30, val_check_interval=5, num_sanity_val_steps=0,
                        logger=False, accelerator="cpu", devices=1, plugins=[tl.CheckpointIO()],
                        callbacks=[tl.SaveOnPreemption(), L.pytorch.callbacks.ModelCheckpoint(save_last=True)],
                        enable_progress_bar=False, enable_model_summary=False)
    try:
        with warnings.catch_warnings(), pytest.raises(SystemExit) as stopped:
            warnings.simplefilter("ignore")
            trainer.fit(SignalledWhileValidating(), train_dataloaders=data, val_dataloaders=data)
    finally:
        preemption.clear()
        preemption.uninstall()
    assert stopped.value.code == 143
    assert tl.CheckpointIO().load_checkpoint(str(run / "checkpoints" / "last.ckpt"))["global_step"] == 5


# -- real processes, real signals ---------------------------------------------------------------------------------


def run_trials(tmp_path: Path, root: str, trials: list[dict[str, Any]], env: dict[str, str] | None = None,
               sleep: float = 0.1) -> list[dict[str, Any]]:
    spec, results = tmp_path / "spec.json", tmp_path / "results.json"
    spec.write_text(json.dumps({"argv": ["--root", root, "--steps", "100000", "--sleep", str(sleep)],
                                "trials": trials}))
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    environment.update(env or {}, TMPDIR=str(tmp_path))
    proc = zygote.run(zygote.LIGHTNING, [str(TRIALS), str(spec), str(results)], environment, cwd=os.getcwd(),
                      timeout=300 + 30 * len(trials))  # a process of its own, forked from one that imported Lightning
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(results.read_text())


def assert_resumed_where_it_stopped(stopped: dict[str, Any], resumed: dict[str, Any], last: str) -> None:
    """The resumed fit started from ``last`` at the step the stopped one saved, with its weights."""
    assert resumed["out"]["ckpt_path"] == last
    assert resumed["out"]["start_step"] == stopped["out"]["end_step"] == stopped["steps"][-1]
    assert resumed["out"]["start_weights"] == stopped["out"]["end_weights"]


def test_sigkill_at_random_moments_then_sigterm_each_resume_loads_a_verified_checkpoint(tmp_path: Path) -> None:
    kill_then_terminate(tmp_path, SIGKILL_TRIALS)


@pytest.mark.campaign("100 SIGKILLs of a Lightning run at random moments, each resumed from last.ckpt")
@pytest.mark.timeout(1800)
def test_sigkill_campaign_each_resume_loads_a_verified_checkpoint(tmp_path: Path) -> None:
    kill_then_terminate(tmp_path, 100)


def kill_then_terminate(tmp_path: Path, kills: int) -> None:
    """``kills`` children killed at random moments, each resuming from the last; then SIGTERM twice. Half the
    moments are drawn in time from the fork (anywhere: setting up, resuming, training), half in steps printed (in
    training, after a random number of steps, with a save of every fifth step in flight or not): on a loaded
    machine the setup alone can outlast any moment drawn in time, and the steps still make the campaign test
    resumes from saved steps."""
    rng = random.Random(int(os.environ.get("TASKPOINT_TEST_SEED", "23")))
    trials: list[dict[str, Any]] = [{"signal": "KILL", "after_s": rng.uniform(0.8, 3.0)} if i % 2 else
                                    {"signal": "KILL", "after_steps": rng.randint(6, 30)} for i in range(kills)]
    trials += [{"signal": "TERM", "after_steps": 4}, {"signal": "TERM", "after_steps": 1}]
    run = tmp_path / "run"
    results = run_trials(tmp_path, str(run), trials, sleep=0.05)

    last = str(run / "checkpoints" / "last.ckpt")
    high = 0
    for i, trial in enumerate(results[:kills]):
        assert trial["status"] == -9 and not trial["errors"], (i, trial)
        if trial["out"] is None:
            continue  # killed before the fit began
        start = trial["out"]["start_step"]
        # never back to an older save than the last one seen, and from last.ckpt whenever one existed
        assert start >= high, (i, start, high)
        assert (trial["out"]["ckpt_path"] == last) == (start > 0), (i, trial["out"]["ckpt_path"])
        # step N is printed before ModelCheckpoint saves it: a step printed after it proves the save committed
        high = max(high, start, *(s for s in trial["steps"][:-1] if s % 5 == 0))
    assert high > 0, "no trial lived long enough to save: the campaign tested nothing"

    signalled, resumed = results[kills:]
    assert signalled["status"] == resumed["status"] == 143
    assert not signalled["errors"] and not resumed["errors"]
    assert_resumed_where_it_stopped(signalled, resumed, last)


def test_sigterm_mid_epoch_on_s3_exits_143_and_resumes_at_that_step(tmp_path: Path, s3_server: Any) -> None:
    location = s3_server.new_location()
    env = {"TASKPOINT_STORAGE_OPTIONS": json.dumps(location.storage_options),
           "AWS_ENDPOINT_URL": s3_server.endpoint}
    root = location.url("run")
    signalled, resumed = run_trials(tmp_path, root, [{"signal": "TERM", "after_steps": 3},
                                                     {"signal": "TERM", "after_steps": 2}], env, sleep=0.05)
    assert (signalled["status"], resumed["status"]) == (143, 143), (signalled, resumed)
    assert signalled["out"]["ckpt_path"] is None
    assert signalled["steps"][-1] < 16  # mid-epoch: 16 batches an epoch
    assert_resumed_where_it_stopped(signalled, resumed, f"{root}/checkpoints/last.ckpt")
    assert resumed["steps"][0] == signalled["steps"][-1] + 1
