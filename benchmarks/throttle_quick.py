"""The throttling section of ``make bench`` (:mod:`benchmarks._throttle`) on its own, with its settings at hand.

Run: ``PYTHONPATH=src python -m benchmarks.throttle_quick [--steps 30] [--rate 0.1] [--kib 64] [--delay-ms 10]
[--rounds 3]``. With ``--delay-ms 0`` (moto answers in well under a millisecond) the ratio is that of the backoff
pauses to almost nothing, an upper bound; the default, 10 ms each way, is a store in the same region (5-30 ms).
"""

from __future__ import annotations

import argparse

from . import _throttle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=_throttle.STEPS)
    parser.add_argument("--rate", type=float, default=_throttle.RATE)
    parser.add_argument("--kib", type=int, default=_throttle.KIB)
    parser.add_argument("--delay-ms", type=float, default=_throttle.DELAY * 1e3, help="latency the proxy adds each way")
    parser.add_argument("--rounds", type=int, default=_throttle.ROUNDS)
    args = parser.parse_args()
    delay = args.delay_ms / 1000
    rows = _throttle.run(args.rounds, steps=args.steps, rate=args.rate, kib=args.kib, delay=delay)
    print(_throttle.notes(delay, args.steps, args.kib))
    print(_throttle.table(rows))


if __name__ == "__main__":
    main()
