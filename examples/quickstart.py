"""taskpoint in one minute: a retried task saves its model folder and survives preemptions.

Run it with ``make demo`` (or ``python examples/quickstart.py``). A task works through 100 steps and saves
its state, a small model folder (weights, optimizer state, a JSON file), every 10 steps. The first attempts
are "preempted" at random; each new attempt loads the newest checkpoint, says where it resumed and how fast
saving and loading went, and the last attempt finishes the work with the same result as an uninterrupted
run. At the end, ``taskpoint ls`` shows what the run left in storage, printed as a command that works here
(``.venv/bin/taskpoint ls ...`` after ``make demo``, whose venv is not active in the user's shell).
Checkpoints go to ``./.taskpoint`` unless ``TASKPOINT_ROOT`` (or ``make demo ROOT=s3://bucket/prefix``)
points elsewhere.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import tempfile
from pathlib import Path

import taskpoint
from taskpoint.cli import main as taskpoint_command

STEPS = 100
SAVE_EVERY = 10
WEIGHTS = 4 << 20  # bytes of "weights"; the optimizer state is half as large


class Figures(logging.Handler):
    """Collects the figures taskpoint logs for each save and load (``record.transfer``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.saves: list = []
        self.loads: list = []

    def emit(self, record: logging.LogRecord) -> None:
        stats = getattr(record, "transfer", None)
        if stats is not None:
            (self.saves if stats.operation == "save" else self.loads).append(stats)


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def write_model(folder: Path, state: dict) -> None:
    """The model folder of ``state``: its weights depend on the step, so a resume can be checked byte for byte."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(state["step"])
    (folder / "weights.bin").write_bytes(rng.randbytes(WEIGHTS))
    (folder / "optimizer").mkdir(exist_ok=True)
    (folder / "optimizer" / "moments.bin").write_bytes(rng.randbytes(WEIGHTS // 2))
    (folder / "state.json").write_text(json.dumps(state))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="seed for the failures (default: random)")
    parser.add_argument("--failing-attempts", type=int, default=2, help="how many attempts fail (default 2)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    chaos = random.Random(args.seed)
    figures = Figures()
    logging.getLogger("taskpoint").addHandler(figures)
    logging.getLogger("taskpoint").setLevel(logging.INFO)
    print(f"taskpoint demo: a task runs {STEPS} steps and saves its model folder ({mib(WEIGHTS * 1.5)}) every "
          f"{SAVE_EVERY} steps; {args.failing_attempts} attempts get preempted.", flush=True)

    @taskpoint.task(retries=3)
    def train() -> tuple[int, str]:
        c = taskpoint.ctx()
        assert c is not None and c.checkpoint is not None
        figures.saves.clear()
        prev = c.checkpoint.load_sync()  # a folder, or None on the first attempt
        if prev is None:
            state = {"step": 0, "total": 0}
            print(f"attempt {c.attempt}/{c.max_attempts}: started from scratch")
        else:
            state = json.loads((prev / "state.json").read_text())
            intact = (prev / "weights.bin").read_bytes() == random.Random(state["step"]).randbytes(WEIGHTS)
            load = figures.loads[-1]
            print(f"attempt {c.attempt}/{c.max_attempts}: resumed at step {state['step']} (loaded "
                  f"{mib(load.bytes)} in {load.total_seconds * 1000:.0f} ms, {load.mb_per_s:.0f} MB/s; weights "
                  f"{'intact' if intact else 'DIFFERENT'})")

        fail_at = chaos.randrange(state["step"] + 1, STEPS) if c.attempt <= args.failing_attempts else None
        with tempfile.TemporaryDirectory() as scratch:
            model = Path(scratch) / "model"
            for step in range(state["step"], STEPS):
                if step == fail_at:
                    print(f"  preempted at step {step} after {summary(figures.saves)}")
                    raise RuntimeError(f"simulated preemption at step {step}")
                state["total"] += step * step
                state["step"] = step + 1
                if state["step"] % SAVE_EVERY == 0:
                    write_model(model, state)
                    c.checkpoint.save_sync(model)  # atomic, checksummed, to this attempt's folder
            print(f"  finished after {summary(figures.saves)}")
        return int(state["total"]), c.checkpoint.remote_destination

    result, last = train()
    run_folder = last.rsplit("/", 3)[0]
    expected = sum(i * i for i in range(STEPS))
    print(f"result: {result} (expected {expected}) {'OK' if result == expected else 'MISMATCH'}")
    command = installed_command()
    for uri in (run_folder, last):
        print(f"\n$ {command} ls {uri}")
        taskpoint_command(["ls", uri])
    print(f"\nMore: {command} show, verify or pull {last} ({command} --help, docs/cli.md)")
    activate = Path(command).parent / "activate"
    if command.endswith("/taskpoint") and activate.exists():
        print(f"(or activate the venv, `source {activate}`, and type `taskpoint`)")


def installed_command() -> str:
    """The ``taskpoint`` command as this shell can type it: plain when PATH finds this python's script (an active
    venv), else the script's path, relative when it is below the current folder (``.venv/bin/taskpoint``)."""
    script = Path(sys.executable).parent / "taskpoint"
    if not script.exists():
        return f"{sys.executable} -m taskpoint.cli"
    found = shutil.which("taskpoint")
    if found is not None and Path(found).resolve() == script.resolve():
        return "taskpoint"
    return str(script.relative_to(Path.cwd())) if script.is_relative_to(Path.cwd()) else str(script)


def summary(saves: list) -> str:
    if not saves:
        return "no save"
    stored = sum(s.bytes for s in saves)
    seconds = sum(s.total_seconds for s in saves)
    plural = "s" if len(saves) > 1 else ""
    return (f"{len(saves)} save{plural} of {mib(stored / len(saves))}, {seconds / len(saves) * 1000:.0f} ms each "
            f"({stored / 1e6 / seconds:.0f} MB/s)")


if __name__ == "__main__":
    main()
