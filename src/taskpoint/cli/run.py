"""``taskpoint run``: run a command with checkpoint locations in its environment."""

from __future__ import annotations

import os
import sys

import click

from ..runtime import layout
from ..storage import check_uri
from ._app import cli


@cli.command("run", context_settings={"allow_interspersed_args": False})
@click.option("--checkpoint-path", help="where this attempt saves (any fsspec URL)")
@click.option("--prev-checkpoint", help="where the previous attempt saved")
@click.option("--root", help="storage root for root mode (sets TASKPOINT_ROOT)")
@click.option("--run-name", help="run name (sets TASKPOINT_RUN_NAME)")
@click.option("--action-name", help="action name (sets TASKPOINT_ACTION_NAME; default 'main' in root mode)")
@click.option("--attempt", type=int, help="attempt number from 1 (sets TASKPOINT_ATTEMPT)")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def run_command(checkpoint_path: str | None, prev_checkpoint: str | None, root: str | None, run_name: str | None,
                action_name: str | None, attempt: int | None, cmd: tuple[str, ...]) -> int:
    """Run CMD so that taskpoint.ctx() inside it has a checkpoint.

    Give the locations (--checkpoint-path/--prev-checkpoint, Flyte's flags) or a root, run and action (the
    attempt then comes from --attempt, an orchestrator's restart counter, or storage). Exit code: CMD's; 2
    for a usage error, 127 when CMD is not found.

    \b
    Examples:
      taskpoint run --root s3://bucket/runs --run-name job7 -- python train.py
      taskpoint run --checkpoint-path s3://b/2/ckpt --prev-checkpoint s3://b/1/ckpt -- python train.py
    """
    args = list(cmd)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        click.echo("taskpoint run: give the command to run after --", err=True)
        return 2
    if prev_checkpoint and not checkpoint_path:
        click.echo("taskpoint run: --prev-checkpoint needs --checkpoint-path", err=True)
        return 2
    if attempt is not None and attempt < 1:
        click.echo("taskpoint run: --attempt counts from 1", err=True)
        return 2
    env = dict(os.environ)
    for name, value in ((layout.ENV_CHECKPOINT_PATH, checkpoint_path), (layout.ENV_PREV_CHECKPOINT, prev_checkpoint),
                        (layout.ENV_ROOT, root), (layout.ENV_RUN_NAME, run_name),
                        (layout.ENV_ACTION_NAME, action_name),
                        (layout.ENV_ATTEMPT, None if attempt is None else str(attempt))):
        if value is not None:
            env[name] = value
    if env.get(layout.ENV_ROOT) and env.get(layout.ENV_RUN_NAME) and not env.get(layout.ENV_ACTION_NAME):
        env[layout.ENV_ACTION_NAME] = "main"
    if not env.get(layout.ENV_CHECKPOINT_PATH) and not (env.get(layout.ENV_ROOT) and env.get(layout.ENV_RUN_NAME)):
        click.echo("taskpoint run: give --checkpoint-path, or --root with --run-name", err=True)
        return 2
    for flag, name, given in (("--checkpoint-path", layout.ENV_CHECKPOINT_PATH, checkpoint_path),
                              ("--prev-checkpoint", layout.ENV_PREV_CHECKPOINT, prev_checkpoint),
                              ("--root", layout.ENV_ROOT, root)):
        try:  # here, not in CMD: a malformed URL must never start a run that saves to a local folder
            check_uri(env.get(name, "").strip(), flag if given is not None else f"${name}")
        except ValueError as exc:
            click.echo(f"taskpoint run: {exc}", err=True)
            return 2
    sys.stdout.flush()
    try:
        os.execvpe(args[0], args, env)
    except FileNotFoundError:
        click.echo(f"taskpoint run: command not found: {args[0]}", err=True)
        return 127
    return 0  # pragma: no cover - exec does not return
