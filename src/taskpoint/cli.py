"""The ``taskpoint`` command line: run a command with checkpoint locations, clean up leftovers."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .runtime import layout


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taskpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="run CMD with checkpoint locations in its environment",
        description="Run CMD so that taskpoint.ctx() inside it has a checkpoint. Give the locations "
                    "(--checkpoint-path/--prev-checkpoint, Flyte's flags) or a root, run and action "
                    "(the attempt then comes from --attempt, an orchestrator's restart counter, or storage).")
    run.add_argument("--checkpoint-path", help="where this attempt saves (any fsspec URL)")
    run.add_argument("--prev-checkpoint", help="where the previous attempt saved")
    run.add_argument("--root", help="storage root for root mode (sets TASKPOINT_ROOT)")
    run.add_argument("--run-name", help="run name (sets TASKPOINT_RUN_NAME)")
    run.add_argument("--action-name", help="action name (sets TASKPOINT_ACTION_NAME; default 'main' in root mode)")
    run.add_argument("--attempt", type=int, help="attempt number from 1 (sets TASKPOINT_ATTEMPT)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    gc = sub.add_parser("gc", help="remove leftovers of interrupted saves under a CheckpointManager directory",
                        description="Remove leftovers of interrupted saves under a CheckpointManager directory. "
                                    "Storage options (credentials, endpoint_url, ...) come from "
                                    f"${layout.ENV_STORAGE_OPTIONS} (a JSON object), as for tasks.")
    gc.add_argument("directory", help="the manager's directory (any fsspec URL)")
    gc.add_argument("--grace", type=float, default=None,
                    help="only remove leftovers older than this many seconds (default: the manager's)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    return _gc(args)


def _run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("taskpoint run: give the command to run after --", file=sys.stderr)
        return 2
    if args.prev_checkpoint and not args.checkpoint_path:
        print("taskpoint run: --prev-checkpoint needs --checkpoint-path", file=sys.stderr)
        return 2
    if args.attempt is not None and args.attempt < 1:
        print("taskpoint run: --attempt counts from 1", file=sys.stderr)
        return 2
    env = dict(os.environ)
    for name, value in ((layout.ENV_CHECKPOINT_PATH, args.checkpoint_path),
                        (layout.ENV_PREV_CHECKPOINT, args.prev_checkpoint), (layout.ENV_ROOT, args.root),
                        (layout.ENV_RUN_NAME, args.run_name),
                        (layout.ENV_ACTION_NAME, args.action_name),
                        (layout.ENV_ATTEMPT, None if args.attempt is None else str(args.attempt))):
        if value is not None:
            env[name] = value
    if env.get(layout.ENV_ROOT) and env.get(layout.ENV_RUN_NAME) and not env.get(layout.ENV_ACTION_NAME):
        env[layout.ENV_ACTION_NAME] = "main"
    if not env.get(layout.ENV_CHECKPOINT_PATH) and not (env.get(layout.ENV_ROOT) and env.get(layout.ENV_RUN_NAME)):
        print("taskpoint run: give --checkpoint-path, or --root with --run-name", file=sys.stderr)
        return 2
    sys.stdout.flush()
    try:
        os.execvpe(cmd[0], cmd, env)
    except FileNotFoundError:
        print(f"taskpoint run: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - exec does not return


def _gc(args: argparse.Namespace) -> int:
    from .manager import CheckpointManager

    try:
        options = layout.env_storage_options()  # credentials, endpoint_url...: as the saving task had them
    except ValueError as exc:
        print(f"taskpoint gc: {exc}", file=sys.stderr)
        return 2
    with CheckpointManager(args.directory, storage_options=options) as manager:
        removed = manager.gc(grace_seconds=args.grace) if args.grace is not None else manager.gc()
    for uri in removed:
        print(f"removed {uri}")
    print(f"taskpoint gc: {len(removed)} leftover(s) removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
