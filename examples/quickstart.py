"""taskpoint in one minute: a task with retries works through 100 steps and survives failures.

Run it with ``make demo`` (or ``python examples/quickstart.py``). The first attempts fail at random, as a
preempted job would; each attempt loads the newest checkpoint, says where it resumed and how long loading
and saving took, and the last attempt finishes the work. Checkpoints go to ``./.taskpoint`` unless
``TASKPOINT_ROOT`` (or ``make demo ROOT=s3://bucket/prefix``) points elsewhere.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import taskpoint

STEPS = 100
SAVE_EVERY = 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="seed for the failures (default: random)")
    parser.add_argument("--failing-attempts", type=int, default=2, help="how many attempts fail (default 2)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    chaos = random.Random(args.seed)

    @taskpoint.task(retries=3)
    def sum_of_squares() -> int:
        c = taskpoint.ctx()
        assert c is not None and c.checkpoint is not None
        started = time.perf_counter()
        prev = c.checkpoint.load_sync()
        load_ms = (time.perf_counter() - started) * 1000
        state = json.loads(prev.read_bytes()) if prev else {"step": 0, "total": 0}
        where = f"resumed at step {state['step']}" if prev else "started from scratch"
        print(f"attempt {c.attempt}/{c.max_attempts}: {where} (load {load_ms:.1f} ms)")

        fail_at = chaos.randrange(state["step"] + 1, STEPS) if c.attempt <= args.failing_attempts else None
        save_ms = []
        for step in range(state["step"], STEPS):
            if step == fail_at:
                print(f"  attempt {c.attempt} crashes at step {step} "
                      f"(saves took {sum(save_ms):.1f} ms in all, {len(save_ms)} saves)")
                raise RuntimeError(f"simulated preemption at step {step}")
            state["total"] += step * step
            state["step"] = step + 1
            if state["step"] % SAVE_EVERY == 0:
                t = time.perf_counter()
                c.checkpoint.save_sync(json.dumps(state).encode())
                save_ms.append((time.perf_counter() - t) * 1000)
        print(f"  attempt {c.attempt} finished ({len(save_ms)} saves, {sum(save_ms):.1f} ms in all)")
        print(f"  checkpoints of this run: {c.checkpoint.remote_destination.rsplit('/', 3)[0]}")
        return int(state["total"])

    result = sum_of_squares()
    expected = sum(i * i for i in range(STEPS))
    print(f"result: {result} (expected {expected}) {'OK' if result == expected else 'MISMATCH'}")


if __name__ == "__main__":
    main()
