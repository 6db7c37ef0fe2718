"""repair_prev_checkpoint_uri: Flyte's retry URI repair, rule by rule and at each boundary."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from taskpoint import TaskContext, repair_prev_checkpoint_uri
from taskpoint.runtime.repair import ATTEMPT_ENV
from taskpoint.runtime.state import reset_context as _reset_context
from taskpoint.runtime.state import set_context as _set_context

RUN = {"run_name": "r1", "action_name": "a0"}


@pytest.fixture(autouse=True)
def _no_ambient_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ATTEMPT_ENV, raising=False)


@pytest.fixture
def task_context(request: pytest.FixtureRequest) -> Iterator[TaskContext]:
    run_name, action_name, attempt = request.param
    value = TaskContext(run_name=run_name, action_name=action_name, attempt=attempt, max_attempts=5)
    token = _set_context(value)
    yield value
    _reset_context(token)


CASES = [
    # Every remote scheme is repaired; the scheme is compared case-insensitively.
    *(
        pytest.param(f"{s}://bkt/org/r1/a0/2/_flytecheckpoints", RUN, None,
                     f"{s}://bkt/org/r1/a0/1/_flytecheckpoints", id=f"scheme-{s}")
        for s in ("s3", "s3a", "gs", "gcs", "abfs", "abfss", "az")
    ),
    pytest.param("S3://bkt/r1/a0/2/c", RUN, None, "S3://bkt/r1/a0/1/c", id="scheme-uppercase"),
    # Local paths and other schemes are never rewritten.
    pytest.param("/data/r1/a0/2/_flytecheckpoints", RUN, None, "/data/r1/a0/2/_flytecheckpoints", id="local-abs"),
    pytest.param("r1/a0/2/c", RUN, None, "r1/a0/2/c", id="local-relative"),
    pytest.param("file:///data/r1/a0/2/c", RUN, None, "file:///data/r1/a0/2/c", id="file-scheme"),
    pytest.param("memory://bkt/r1/a0/2/c", RUN, None, "memory://bkt/r1/a0/2/c", id="memory-scheme"),
    pytest.param("https://host/r1/a0/2/c", RUN, None, "https://host/r1/a0/2/c", id="https-scheme"),
    pytest.param("hdfs://nn/r1/a0/2/c", RUN, None, "hdfs://nn/r1/a0/2/c", id="hdfs-scheme"),
    pytest.param("s3:/bkt/r1/a0/2/c", RUN, None, "s3:/bkt/r1/a0/2/c", id="scheme-without-slashes"),
    # n <= 1: there is no earlier attempt.
    pytest.param("s3://bkt/r1/a0/1/c", RUN, None, "s3://bkt/r1/a0/1/c", id="n-1-kept"),
    pytest.param("s3://bkt/r1/a0/0/c", RUN, None, "s3://bkt/r1/a0/0/c", id="n-0-kept"),
    pytest.param("s3://bkt/r1/a0/2/c", RUN, None, "s3://bkt/r1/a0/1/c", id="n-2-rewritten"),
    pytest.param("s3://bkt/r1/a0/22/c", RUN, None, "s3://bkt/r1/a0/21/c", id="n-multi-digit"),
    # Attempt guard: A >= 1 allows only n == A or n == A + 1.
    pytest.param("s3://bkt/r1/a0/3/c", {**RUN, "attempt": 3}, None, "s3://bkt/r1/a0/2/c", id="n-eq-A"),
    pytest.param("s3://bkt/r1/a0/4/c", {**RUN, "attempt": 3}, None, "s3://bkt/r1/a0/3/c", id="n-eq-A+1"),
    pytest.param("s3://bkt/r1/a0/5/c", {**RUN, "attempt": 3}, None, "s3://bkt/r1/a0/5/c", id="n-eq-A+2-kept"),
    pytest.param("s3://bkt/r1/a0/2/c", {**RUN, "attempt": 3}, None, "s3://bkt/r1/a0/2/c", id="n-eq-A-1-kept"),
    pytest.param("s3://bkt/r1/a0/2/c", {**RUN, "attempt": 1}, None, "s3://bkt/r1/a0/1/c", id="A-1-n-2"),
    pytest.param("s3://bkt/r1/a0/3/c", {**RUN, "attempt": 1}, None, "s3://bkt/r1/a0/3/c", id="A-1-n-3-kept"),
    pytest.param("s3://bkt/r1/a0/5/c", {**RUN, "attempt": 0}, None, "s3://bkt/r1/a0/4/c", id="A-0-no-guard"),
    pytest.param("s3://bkt/r1/a0/5/c", {**RUN, "attempt": -1}, None, "s3://bkt/r1/a0/4/c", id="A-negative-no-guard"),
    pytest.param("s3://bkt/r1/a0/7/c", RUN, None, "s3://bkt/r1/a0/6/c", id="A-unknown-no-guard"),
    # FLYTE_ATTEMPT_NUMBER stands in for the argument; the argument wins over it; junk is ignored.
    pytest.param("s3://bkt/r1/a0/3/c", RUN, "2", "s3://bkt/r1/a0/2/c", id="env-n-eq-A+1"),
    pytest.param("s3://bkt/r1/a0/2/c", RUN, "2", "s3://bkt/r1/a0/1/c", id="env-n-eq-A"),
    pytest.param("s3://bkt/r1/a0/4/c", RUN, "2", "s3://bkt/r1/a0/4/c", id="env-n-eq-A+2-kept"),
    pytest.param("s3://bkt/r1/a0/6/c", RUN, "0", "s3://bkt/r1/a0/5/c", id="env-0-no-guard"),
    pytest.param("s3://bkt/r1/a0/6/c", RUN, "soon", "s3://bkt/r1/a0/5/c", id="env-junk-ignored"),
    pytest.param("s3://bkt/r1/a0/6/c", RUN, "", "s3://bkt/r1/a0/5/c", id="env-empty-ignored"),
    pytest.param("s3://bkt/r1/a0/4/c", {**RUN, "attempt": 3}, "1", "s3://bkt/r1/a0/3/c", id="arg-beats-env"),
    pytest.param("s3://bkt/r1/a0/2/c", {**RUN, "attempt": 3}, "1", "s3://bkt/r1/a0/2/c", id="arg-beats-env-kept"),
    # The run and action must both match whole path segments.
    pytest.param("s3://bkt/r2/a0/2/c", RUN, None, "s3://bkt/r2/a0/2/c", id="run-mismatch"),
    pytest.param("s3://bkt/r1/a1/2/c", RUN, None, "s3://bkt/r1/a1/2/c", id="action-mismatch"),
    pytest.param("s3://bkt/a0/r1/2/c", RUN, None, "s3://bkt/a0/r1/2/c", id="run-action-swapped"),
    pytest.param("s3://bkt/xr1/a0/2/c", RUN, None, "s3://bkt/xr1/a0/2/c", id="run-longer-name"),
    pytest.param("s3://bkt/r1/a0x/2/c", RUN, None, "s3://bkt/r1/a0x/2/c", id="action-longer-name"),
    pytest.param("s3://bkt/r1/x/a0/2/c", RUN, None, "s3://bkt/r1/x/a0/2/c", id="run-action-not-adjacent"),
    pytest.param("s3://bkt/r1/a0/2x/c", RUN, None, "s3://bkt/r1/a0/2x/c", id="attempt-not-a-number"),
    pytest.param("s3://bkt/rx1/a0/2/c", {"run_name": "r.1", "action_name": "a0"}, None,
                 "s3://bkt/rx1/a0/2/c", id="run-name-is-not-a-regex"),
    pytest.param("s3://bkt/r.1/a0/2/c", {"run_name": "r.1", "action_name": "a0"}, None,
                 "s3://bkt/r.1/a0/1/c", id="run-name-with-dot"),
    # Where the segment sits.
    pytest.param("s3://bkt/p/r1/a0/2/sub/dir/c", RUN, None, "s3://bkt/p/r1/a0/1/sub/dir/c", id="segment-middle"),
    pytest.param("s3://bkt/p/r1/a0/2", RUN, None, "s3://bkt/p/r1/a0/1", id="segment-at-end"),
    pytest.param("s3://bkt/p/r1/a0/2/", RUN, None, "s3://bkt/p/r1/a0/1/", id="segment-trailing-slash"),
    pytest.param("s3://r1/a0/2/c", RUN, None, "s3://r1/a0/1/c", id="run-is-bucket"),
    pytest.param("s3://bkt/r1/a0/2/r1/a0/2/c", RUN, None, "s3://bkt/r1/a0/1/r1/a0/2/c", id="first-occurrence-only"),
    # Whitespace and quotes are stripped, everywhere; nothing left means no previous checkpoint.
    pytest.param('  "s3://bkt/r1/a0/2/c"\n', RUN, None, "s3://bkt/r1/a0/1/c", id="double-quotes-whitespace"),
    pytest.param("'s3://bkt/r1/a0/2/c'", RUN, None, "s3://bkt/r1/a0/1/c", id="single-quotes"),
    pytest.param('" s3://bkt/r1/a0/2/c "', RUN, None, "s3://bkt/r1/a0/1/c", id="whitespace-inside-quotes"),
    pytest.param(' "/tmp/ckpt" ', RUN, None, "/tmp/ckpt", id="local-stripped"),
    pytest.param(None, RUN, None, None, id="none"),
    pytest.param("", RUN, None, None, id="empty"),
    pytest.param("   ", RUN, None, None, id="blank"),
    pytest.param('""', RUN, None, None, id="empty-quotes"),
    pytest.param(" ' ' ", RUN, None, None, id="quoted-blank"),
    # Without a run and an action (no context here) nothing can be recognised, so nothing changes.
    pytest.param("s3://bkt/r1/a0/2/c", {}, None, "s3://bkt/r1/a0/2/c", id="no-run-no-action"),
    pytest.param("s3://bkt/r1/a0/2/c", {"run_name": "r1"}, None, "s3://bkt/r1/a0/2/c", id="no-action"),
    pytest.param("s3://bkt/r1/a0/2/c", {"action_name": "a0"}, None, "s3://bkt/r1/a0/2/c", id="no-run"),
    pytest.param("s3://bkt//a0/2/c", {"run_name": "", "action_name": "a0"}, None, "s3://bkt//a0/2/c", id="empty-run"),
]


@pytest.mark.parametrize(("uri", "kwargs", "env", "expected"), CASES)
def test_repair_prev_checkpoint_uri(
    monkeypatch: pytest.MonkeyPatch, uri: str | None, kwargs: dict[str, Any], env: str | None, expected: str | None
) -> None:
    if env is not None:
        monkeypatch.setenv(ATTEMPT_ENV, env)
    assert repair_prev_checkpoint_uri(uri, **kwargs) == expected


CONTEXT_CASES = [
    # Run, action and attempt all come from the context (attempt 2 allows n in {2, 3}).
    pytest.param(("r1", "a0", 2), "s3://bkt/r1/a0/2/c", {}, None, "s3://bkt/r1/a0/1/c", id="ctx-n-eq-A"),
    pytest.param(("r1", "a0", 2), "s3://bkt/r1/a0/3/c", {}, None, "s3://bkt/r1/a0/2/c", id="ctx-n-eq-A+1"),
    pytest.param(("r1", "a0", 2), "s3://bkt/r1/a0/4/c", {}, None, "s3://bkt/r1/a0/4/c", id="ctx-n-eq-A+2-kept"),
    pytest.param(("r1", "a0", 0), "s3://bkt/r1/a0/4/c", {}, None, "s3://bkt/r1/a0/3/c", id="ctx-A-0-no-guard"),
    pytest.param(("r9", "a0", 2), "s3://bkt/r1/a0/2/c", {}, None, "s3://bkt/r1/a0/2/c", id="ctx-run-mismatch"),
    pytest.param(("r1", "a9", 2), "s3://bkt/r1/a0/2/c", {}, None, "s3://bkt/r1/a0/2/c", id="ctx-action-mismatch"),
    pytest.param(("r1", "a0", 2), "/local/r1/a0/2/c", {}, None, "/local/r1/a0/2/c", id="ctx-local-kept"),
    # Arguments beat the context, each on its own; the environment beats the context's attempt.
    pytest.param(("r9", "a0", 2), "s3://bkt/r1/a0/2/c", {"run_name": "r1"}, None, "s3://bkt/r1/a0/1/c",
                 id="arg-run-ctx-action"),
    pytest.param(("r1", "a9", 2), "s3://bkt/r1/a0/2/c", {"action_name": "a0"}, None, "s3://bkt/r1/a0/1/c",
                 id="ctx-run-arg-action"),
    pytest.param(("r1", "a0", 2), "s3://bkt/r1/a0/4/c", {"attempt": 3}, None, "s3://bkt/r1/a0/3/c",
                 id="arg-attempt-beats-ctx"),
    pytest.param(("r1", "a0", 2), "s3://bkt/r1/a0/4/c", {}, "3", "s3://bkt/r1/a0/3/c", id="env-beats-ctx"),
    pytest.param(("r1", "a0", 2), "s3://bkt/r1/a0/4/c", {}, "junk", "s3://bkt/r1/a0/4/c",
                 id="junk-env-falls-back-to-ctx"),
    pytest.param(("", "a0", 2), "s3://bkt//a0/2/c", {}, None, "s3://bkt//a0/2/c", id="ctx-empty-run"),
]


@pytest.mark.parametrize(("task_context", "uri", "kwargs", "env", "expected"), CONTEXT_CASES,
                         indirect=["task_context"])
def test_repair_prev_checkpoint_uri_defaults_from_context(
    monkeypatch: pytest.MonkeyPatch,
    task_context: TaskContext,
    uri: str,
    kwargs: dict[str, Any],
    env: str | None,
    expected: str,
) -> None:
    if env is not None:
        monkeypatch.setenv(ATTEMPT_ENV, env)
    assert repair_prev_checkpoint_uri(uri, **kwargs) == expected


def test_context_is_not_consulted_outside_a_task() -> None:
    token = _set_context(TaskContext(run_name="r1", action_name="a0", attempt=2, max_attempts=3))
    _reset_context(token)
    assert repair_prev_checkpoint_uri("s3://bkt/r1/a0/2/c") == "s3://bkt/r1/a0/2/c"
