"""The contract every step kind keeps, run over each registered kind on local disk, memory:// and S3.

:func:`check_step_kind` is the contract, written once: a kind's ``store`` writes its objects and returns what it
stored without committing anything; the manager's commit then makes the step exist, its folder holding the manifest
and exactly the objects the kind named, at their sizes; the step reads back, verifies, describes itself, survives a
gc, and no longer verifies once an object it names is gone; once deleted, gc leaves nothing of it. A kind of
another package runs the same function with a :class:`Sample` of its own (docs/manager.md, "Step kinds": how)::

    from test_kind_contract import Sample, check_step_kind   # this file, copied beside the package's tests

    def test_my_kind_keeps_the_contract(tmp_path):
        check_step_kind(str(tmp_path / "steps"), Sample("notes", save=save_a_note, check=read_the_note))
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest

from helpers import LazyModule, requires
from taskpoint import CheckpointManager
from taskpoint.manager.kind_api import MANIFEST_NAME, Stored
from taskpoint.manager.kinds import KINDS, step_kind

torch = LazyModule("torch")
tpt = LazyModule("taskpoint.torch")
dcp = LazyModule("torch.distributed.checkpoint")
jnp = LazyModule("jax.numpy")
tpjax = LazyModule("taskpoint.jax")

PLUGIN = Path(__file__).with_name("kinds_plugin")


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The tests' ``notes`` plug-in, importable and registered for this test only: a test that runs after it in
    the same process sees one without it (test_step_kinds checks what such a process does)."""
    monkeypatch.syspath_prepend(str(PLUGIN))
    try:
        yield importlib.import_module("notes_kind")
    finally:
        KINDS._kinds.pop("notes", None)
        sys.modules.pop("notes_kind", None)


@dataclass(frozen=True)
class Sample:
    """One step of a kind for :func:`check_step_kind`: ``save(manager, step)`` saves it through the manager's
    public API (``save()``, or a writer of the kind's own and then ``commit()``); ``check(manager, step)`` asserts
    that it reads back as saved (``restore()``, or the kind's own reader); ``options``: more arguments of the
    :class:`~taskpoint.CheckpointManager`."""

    kind: str
    save: Callable[[CheckpointManager, int], None]
    check: Callable[[CheckpointManager, int], None]
    options: Mapping[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _watching_store(name: str, manifest_exists: Callable[[int], bool]) -> Iterator[list[Stored]]:
    """The registered kind ``name`` with its ``store`` watched, on its class (a manager of several ranks saves
    through an instance of its own, the ranks' wrapper around the kind a rank chose): each :class:`Stored` it
    returns is kept, once checked that no manifest of the step exists yet where this process commits it (the
    commit is the manager's, never the kind's; a rank > 0's store returns while rank 0 may be committing)."""
    kind = type(step_kind(name))
    store, seen = kind.store, []  # type: ignore[attr-defined]

    def watched(self: Any, context: Any, job: Any) -> Stored:
        stored = store(self, context, job)
        assert stored.content is None or not manifest_exists(job.step), \
            f"kind {name!r} wrote the manifest of step {job.step} itself"
        seen.append(stored)
        return stored

    kind.store = watched  # type: ignore[attr-defined]
    try:
        yield seen
    finally:
        kind.store = store  # type: ignore[attr-defined]


def check_step_kind(url: str, sample: Sample, storage_options: Mapping[str, Any] | None = None) -> None:
    """Save step 1 of ``sample``'s kind in the manager directory ``url`` (empty) and check the contract."""
    options = dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(url, **{k: v for k, v in options.items() if k != "s3_client"})

    def listing() -> dict[str, int]:
        fs.invalidate_cache()
        found = fs.find(root, detail=True) if fs.exists(root) else {}
        return {path[len(root.rstrip("/")) + 1:]: info["size"] for path, info in found.items()}

    with CheckpointManager(url, storage_options=options, preemption=False, **{"grace_seconds": 0, **sample.options}
                           ) as manager:
        with _watching_store(sample.kind, lambda step: f"ckpt-{step}/{MANIFEST_NAME}" in listing()) as seen:
            sample.save(manager, 1)
        assert [s.content.kind for s in seen if s.content is not None] == [sample.kind]
        assert manager.steps() == [1]
        stored = next(s for s in seen if s.content is not None)
        # The step's folder holds its manifest and what the kind said it stored, at those sizes: nothing else.
        held = {name.removeprefix("ckpt-1/"): size for name, size in listing().items() if name.startswith("ckpt-1/")}
        named = {MANIFEST_NAME, *stored.objects}
        assert set(held) == named, (f"step 1's folder holds {sorted(set(held) - named)} that kind {sample.kind!r} "
                                    f"did not name, and lacks {sorted(named - set(held))} that it named")
        assert {name: held[name] for name in stored.objects} == dict(stored.objects)
        sample.check(manager, 1)
        manager.gc()  # a committed step's objects are never leftovers
        (verified,) = manager.verify(1).steps
        assert (verified.step, verified.state, verified.kind) == (1, "healthy", sample.kind)
        described = manager.describe(1)
        assert (described.step, described.kind) == (1, sample.kind)
        sample.check(manager, 1)
        if stored.objects:  # a named object gone: verify says so (the last named: a file of data, not a list)
            fs.rm(f"{root.rstrip('/')}/ckpt-1/{list(stored.objects)[-1]}")
            (damaged,) = manager.verify().steps
            assert damaged.state != "healthy", f"kind {sample.kind!r} verified a step missing an object it named"
        manager.delete(1, force=True)  # the newest step that verifies is protected
        manager.gc()
        assert manager.steps() == []
        left = [name for name in listing() if not name.startswith("leases/")]  # the chunk store's epoch, no step's
        assert left == [], f"gc left {left} of a deleted step of kind {sample.kind!r}"


# -- the registered kinds ---------------------------------------------------------------------------------------

DATA = b"the contract's step\n" * 64


def _save_bytes(manager: CheckpointManager, step: int) -> None:
    manager.save(DATA, step, metadata={"loss": 0.5})


def _restores_bytes(manager: CheckpointManager, step: int) -> None:
    assert manager.restore(step).read_bytes() == DATA


def _saving_two_ranks(data: Callable[[int], Any]) -> Callable[[CheckpointManager, int], None]:
    """What saves a step of two ranks: rank 1's ``data(1)`` from a second manager on a thread, rank 0's
    ``data(0)`` from the manager it is given."""
    def save_both(manager: CheckpointManager, step: int) -> None:
        rank1 = CheckpointManager(manager.directory, rank=1, world_size=2, storage_options=manager.storage_options,
                                  preemption=False)
        failed: list[BaseException] = []

        def save() -> None:
            try:
                rank1.save(data(1), step)
            except BaseException as exc:
                failed.append(exc)

        saver = threading.Thread(target=save)
        saver.start()
        try:
            manager.save(data(0), step)
        finally:
            saver.join(120)
            rank1.close()
        assert not saver.is_alive() and not failed, failed

    return save_both


def _save_notes(manager: CheckpointManager, step: int) -> None:
    import notes_kind

    with fsspec.open(f"{manager.step_uri(step)}/{notes_kind.NOTE}", "wb", **manager.storage_options) as out:
        out.write(DATA)
    manager.commit(step, notes_kind.Note())


def _restores_note(manager: CheckpointManager, step: int) -> None:
    assert manager.restore(step).read_bytes() == DATA


def _state_dict(rank: int) -> Any:
    return tpt.StateDict({"w": torch.arange(300, dtype=torch.float32) + rank})


def _save_state_dict(manager: CheckpointManager, step: int) -> None:
    manager.save(_state_dict(0), step)


def _restores_state_dict(manager: CheckpointManager, step: int) -> None:
    assert torch.equal(tpt.load_state_dict_sync(manager, step)["w"], torch.arange(300, dtype=torch.float32))


def _save_dcp(manager: CheckpointManager, step: int) -> None:
    dcp.save({"w": torch.arange(300, dtype=torch.float32)}, storage_writer=tpt.Writer.for_step(manager, step),
             no_dist=True)


def _restores_dcp(manager: CheckpointManager, step: int) -> None:
    target = {"w": torch.zeros(300)}
    dcp.load(target, storage_reader=tpt.Reader.for_step(manager, step), no_dist=True)
    assert torch.equal(target["w"], torch.arange(300, dtype=torch.float32))


def _save_pytree(manager: CheckpointManager, step: int) -> None:
    manager.save(tpjax.PyTree({"w": jnp.arange(300.0), "step": step}), step)


def _restores_pytree(manager: CheckpointManager, step: int) -> None:
    tree = tpjax.load_pytree_sync(manager, step=step)
    assert tree["step"] == step and list(tree["w"]) == list(jnp.arange(300.0))


#: The options of rank 0 of a step of two ranks.
TWO_RANKS = {"rank": 0, "world_size": 2, "commit_timeout": 60, "grace_seconds": 120}
SAMPLES = [
    pytest.param(Sample("payload", _save_bytes, _restores_bytes), id="payload"),
    pytest.param(Sample("chunked", _save_bytes, _restores_bytes, {"dedup": True}), id="chunked"),
    pytest.param(Sample("sharded", _saving_two_ranks(lambda rank: b"rank one" if rank else DATA), _restores_bytes,
                        TWO_RANKS), id="sharded"),
    pytest.param(Sample("ranks", _saving_two_ranks(_state_dict), _restores_state_dict, TWO_RANKS),
                 id="ranks (a state dict per rank)", marks=requires("torch")),
    pytest.param(Sample("notes", _save_notes, _restores_note), id="notes (a third-party kind)"),
    pytest.param(Sample("torch.state_dict", _save_state_dict, _restores_state_dict), id="torch.state_dict",
                 marks=requires("torch")),
    pytest.param(Sample("fileset", _save_dcp, _restores_dcp), id="fileset (DCP)", marks=requires("torch")),
    pytest.param(Sample("jax.pytree", _save_pytree, _restores_pytree), id="jax.pytree", marks=requires("jax", "orbax")),
]


@pytest.mark.parametrize("store", ["local", "memory", "s3"], indirect=True)
@pytest.mark.parametrize("sample", SAMPLES)
def test_every_registered_kind_keeps_the_contract(sample: Sample, store: Any, plugin: Any) -> None:
    if sample.kind in ("torch.state_dict", "fileset"):
        pass  # registers its kinds
    elif sample.kind == "jax.pytree":
        pass
    check_step_kind(store.url("steps"), sample, store.storage_options)


class _CommitsItself:
    """The third-party kind as written before the manager owned the commit: everything but ``store``."""

    def __init__(self, kind: Any) -> None:
        self._kind = kind

    def __getattr__(self, name: str) -> Any:
        if name == "store":
            raise AttributeError(name)
        return getattr(self._kind, name)


def test_a_kind_that_commits_itself_is_refused_with_what_to_do_and_its_steps_still_load(tmp_path: Path,
                                                                                         plugin: Any) -> None:
    """A kind with a ``save`` that writes the manifest itself and no ``store``: saving says what changed and
    commits nothing; what it saved before still reads."""
    from taskpoint import CheckpointError
    from taskpoint.manager.kinds import register_step_kind

    with CheckpointManager(tmp_path / "steps", preemption=False) as manager:
        _save_notes(manager, 1)
        register_step_kind(_CommitsItself(plugin.NOTES))  # type: ignore[arg-type]
        try:
            with pytest.raises(CheckpointError, match=r"step kind 'notes' cannot save with this taskpoint: it "
                                                      r"commits its steps itself \(save\(\)\).*store\(\)"):
                _save_notes(manager, 2)
            assert manager.steps() == [1]
            _restores_note(manager, 1)
            assert manager.verify(1).steps[0].state == "healthy"
        finally:
            register_step_kind(plugin.NOTES)


def _save_notes_leaving(name: str) -> Callable[[CheckpointManager, int], None]:
    """The note's writer, leaving ``name`` in the step's folder too before the commit."""

    def save(manager: CheckpointManager, step: int) -> None:
        folder = Path(manager.step_uri(step))
        folder.mkdir(parents=True)
        (folder / name).write_bytes(b"{}")
        _save_notes(manager, step)

    return save


@pytest.mark.parametrize(("left", "failure"), [("stray.bin", r"holds \['stray.bin'\] that kind 'notes' did not name"),
                                               (MANIFEST_NAME, "wrote the manifest of step 1 itself")])
def test_the_contract_fails_a_step_that_breaks_it(left: str, failure: str, tmp_path: Path, plugin: Any) -> None:
    """An object in the step's folder that the kind did not name, or a manifest there before the commit."""
    with pytest.raises(AssertionError, match=failure):
        check_step_kind(str(tmp_path / "steps"), Sample("notes", _save_notes_leaving(left), _restores_note))
