"""The constructor's option values: the older keywords and the values make the same manager, an older keyword
beside the value that holds it is refused, and each value checks its fields where it is made."""

from __future__ import annotations

import ast
import dataclasses
import datetime
from pathlib import Path

import pytest

import taskpoint
from taskpoint import BackgroundSaves, CheckpointManager, KeepBest, Retention, Schedule, Shards, Tier

#: One value for every older keyword, none of them its default.
OLDER = {
    "keep": 2, "keep_every": 4, "keep_best": KeepBest("loss", k=1),
    "save_interval_steps": 3, "save_interval": datetime.timedelta(hours=1),
    "async_save": True, "snapshot_dir": None, "background_process": False, "max_staging_bytes": 1 << 20,
    "rank": 0, "world_size": 1, "commit_timeout": 30.0,
    "local_dir": None, "local_keep": 3, "remote_every": 2,
}
#: The option value of each keyword that takes one, and the fields it holds.
VALUES = {"retention": Retention, "schedule": Schedule, "background": BackgroundSaves, "shards": Shards, "tier": Tier}


def _older(tmp_path: Path) -> dict[str, object]:
    (tmp_path / "snapshots").mkdir(exist_ok=True)
    return {**OLDER, "snapshot_dir": str(tmp_path / "snapshots"), "local_dir": str(tmp_path / "local")}


def _values(older: dict[str, object]) -> dict[str, object]:
    return {name: kind(**{field.name: older[field.name] for field in dataclasses.fields(kind)})
            for name, kind in VALUES.items()}


def test_every_older_keyword_is_a_field_of_exactly_one_option_value() -> None:
    fields = [field.name for kind in VALUES.values() for field in dataclasses.fields(kind)]
    assert sorted(fields) == sorted(OLDER)  # 15 keywords, each in one value, none twice


def test_older_keywords_and_option_values_make_the_same_manager(tmp_path: Path) -> None:
    older = _older(tmp_path)
    with CheckpointManager(tmp_path / "a", preemption=False, **older) as a, \
            CheckpointManager(tmp_path / "b", preemption=False,
                              **_values({**older, "local_dir": str(tmp_path / "local-b")})) as b:
        assert a._options == dataclasses.replace(b._options, tier=dataclasses.replace(
            b._options.tier, local_dir=older["local_dir"]))
        assert repr(a).split(",", 1)[1] == repr(b).split(",", 1)[1]
        for step in range(1, 9):
            assert a.should_save(step) == b.should_save(step) == (step % 3 == 0)
            for manager in (a, b):
                manager.save(b"x%d" % step, step, metadata={"loss": 1.0 / step})
        a.wait_until_finished()
        b.wait_until_finished()
        assert a.steps("remote") == b.steps("remote") and a.steps("local") == b.steps("local") == [6, 7, 8]
        assert a.steps("remote") == [4, 6, 8]  # remote_every=2; keep=2 and keep_every=4 (8 the best, the newest)
        assert (a.rank, a.world_size) == (b.rank, b.world_size) == (0, 1)


def test_the_defaults_are_the_defaults_of_the_older_keywords(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "a", preemption=False) as a, \
            CheckpointManager(tmp_path / "b", preemption=False, retention=Retention(), schedule=Schedule(),
                              background=BackgroundSaves(), shards=Shards(), tier=None) as b:
        assert a._options == b._options and a._options.tier is None
        assert repr(a).endswith("keep=None, keep_every=None)")


@pytest.mark.parametrize("keyword", sorted(OLDER))
def test_an_older_keyword_beside_the_value_that_holds_it_is_refused_naming_both(tmp_path: Path, keyword: str) -> None:
    older = _older(tmp_path)
    name = next(name for name, kind in VALUES.items() if keyword in {f.name for f in dataclasses.fields(kind)})
    with pytest.raises(TypeError, match=rf"{keyword}= and {name}= were both given"):
        CheckpointManager(tmp_path, preemption=False, **{keyword: older[keyword], name: _values(older)[name]})
    assert [path.name for path in tmp_path.iterdir()] == ["snapshots"]  # refused before anything was made


def test_older_keywords_beside_another_value_mix(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, preemption=False, keep=1, schedule=Schedule(save_interval_steps=2)) as m:
        assert m._options.retention == Retention(keep=1) and m.should_save(4) and not m.should_save(5)
        m.save(b"1", 1)
        m.save(b"2", 2)
        assert m.steps() == [2]


def test_an_unknown_keyword_or_a_value_of_another_type_is_a_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_last'"):
        CheckpointManager(tmp_path, keep_last=3)
    with pytest.raises(TypeError, match=r"retention must be a taskpoint\.Retention or None, not int"):
        CheckpointManager(tmp_path, retention=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tier must be a taskpoint\.Tier or None, not str"):
        CheckpointManager(tmp_path, tier=str(tmp_path))  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "error", "message"), [
    (lambda: Retention(keep=0), ValueError, "keep must be at least 1, got 0"),
    (lambda: Retention(keep_every=True), TypeError, "keep_every must be an int or None, not bool"),
    (lambda: Retention(keep_best="loss"), TypeError, "keep_best must be a taskpoint.KeepBest or None, not str"),
    (lambda: Schedule(save_interval_steps=0), ValueError, "save_interval_steps must be at least 1, got 0"),
    (lambda: Schedule(save_interval=-1), ValueError, "save_interval must be more than 0 seconds"),
    (lambda: Schedule(save_interval="1h"), TypeError, "save_interval must be a datetime.timedelta or a number"),
    (lambda: BackgroundSaves(max_staging_bytes=0), ValueError, "max_staging_bytes must be a positive int or None"),
    (lambda: BackgroundSaves(snapshot_dir=3), TypeError, "snapshot_dir must be a str URI or an os.PathLike"),
    (lambda: Shards(commit_timeout=0), ValueError, "commit_timeout must be a number of seconds > 0, got 0"),
    (lambda: Tier("/nvme", local_keep=0), ValueError, "local_keep must be at least 1, got 0"),
    (lambda: Tier("/nvme", remote_every=None), TypeError, "remote_every must be an int >= 1, not None"),
    (lambda: Tier(7), TypeError, "local_dir must be a str URI or an os.PathLike, not int"),
])
def test_each_value_checks_its_fields_where_it_is_made_as_the_keyword_did(
        value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        value()  # type: ignore[operator]


@pytest.mark.parametrize(("older", "error", "message"), [
    ({"keep": 0}, ValueError, "keep must be at least 1, got 0"),
    ({"save_interval_steps": 0}, ValueError, "save_interval_steps must be at least 1, got 0"),
    ({"max_staging_bytes": 0}, ValueError, "max_staging_bytes must be a positive int or None"),
    ({"commit_timeout": 0}, ValueError, "commit_timeout must be a number of seconds > 0, got 0"),
    ({"local_dir": "/nvme", "remote_every": None}, TypeError, "remote_every must be an int >= 1, not None"),
])
def test_an_older_keyword_fails_with_the_message_of_its_value(
        tmp_path: Path, older: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        CheckpointManager(tmp_path, preemption=False, **older)


def test_tier_keywords_without_a_local_dir_make_no_tier_as_before(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, preemption=False, local_dir=None, local_keep=5, remote_every=3) as m:
        assert m._options.tier is None
        with pytest.raises(ValueError, match="has no local tier"):
            m.steps("local")


def test_cross_checks_of_the_values_name_their_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"commit_timeout \(60 s\) must be shorter than grace_seconds \(30"):
        CheckpointManager(tmp_path, shards=Shards(rank=1, world_size=2, commit_timeout=60), grace_seconds=30)
    with pytest.raises(ValueError, match="dedup=True cannot be combined with local_dir"):
        CheckpointManager(tmp_path, tier=Tier(tmp_path / "local"), dedup=True, preemption=False)
    with pytest.raises(ValueError, match="local_dir must be a local path"):
        CheckpointManager(tmp_path, tier=Tier("memory://local"), preemption=False)


def test_list_checkpoints_is_the_datarax_name_for_the_committed_steps_and_their_uris(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, preemption=False) as m:
        for step in (3, 1, 7):
            m.save(b"x", step)
        assert m.list_checkpoints() == {step: m.step_uri(step) for step in m.steps()} and list(
            m.list_checkpoints()) == [1, 3, 7]


def test_the_option_values_are_public_and_frozen() -> None:
    for kind in VALUES.values():
        assert kind.__name__ in taskpoint.__all__ and getattr(taskpoint, kind.__name__) is kind
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(kind(**({"local_dir": "/nvme"} if kind is Tier else {})), dataclasses.fields(kind)[0].name, 1)


def test_no_protocol_of_the_manager_declares_another_class_s_private_attributes() -> None:
    """The manager's parts reach each other through what each offers, never by naming a private attribute in a
    Protocol (as the local tier once reached its local manager's step store and reader)."""
    found = []
    for module in Path(taskpoint.__file__).parent.joinpath("manager").rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Protocol" for b in node.bases):
                names = [item.target.id for item in node.body if isinstance(item, ast.AnnAssign)
                         and isinstance(item.target, ast.Name)]
                names += [item.name for item in node.body if isinstance(item, ast.FunctionDef)]
                found += [f"{module.name}: {node.name}.{name}" for name in names
                          if name.startswith("_") and not name.startswith("__")]
    assert found == []
