"""The reliability campaign of issue 11: ``python -m tests.reliability [--quick] [options]`` from the repo root.

Runs each scenario (see the modules of this package and docs/reliability.md), prints one table (scenario,
store, trials, failures, notes), writes it with every failure's text as JSON under
``tests/reliability/results/``, and exits 1 when anything failed (or a scenario could not run at all).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import FULL_COUNTS, QUICK_COUNTS
from ._common import RESULTS_DIR, Result, Servers, table
from .suite import TIME_ROWS

SCENARIOS = ("sigkill", "faults", "roundtrip", "secrets", "resources", "concurrency", "hostile", "manifests",
             "kill-after-return", *TIME_ROWS, "campaign")
STORES = ("local", "memory", "s3", "gcs", "azure")

def _store_counts(text: str) -> dict[str, int]:
    """``local=50,s3=20`` -> {"local": 50, "s3": 20}."""
    out = {}
    for part in filter(None, text.split(",")):
        name, _, count = part.partition("=")
        if name not in STORES:
            raise argparse.ArgumentTypeError(f"unknown store {name!r}; choose from {', '.join(STORES)}")
        out[name] = int(count)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.reliability", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the bounded campaign (a few trials each)")
    p.add_argument("--only", default=",".join(SCENARIOS),
                   help=f"comma-separated scenarios to run (default all: {','.join(SCENARIOS)})")
    p.add_argument("--stores", default=",".join(STORES),
                   help="comma-separated stores the scenarios may use (default all: local,memory,s3,gcs,azure)")
    p.add_argument("--trials", type=int, help="one count for everything: trials per store and mode, cycles, "
                                              "examples, and seconds and loads of concurrency (for development)")
    p.add_argument("--sigkill", type=_store_counts, help="SIGKILL trials per mode, e.g. local=50,s3=20,gcs=10,azure=10")
    p.add_argument("--sigkill-modes", default=",".join(("checkpoint", "manager", "background-trainer",
                                                        "background-helper")),
                   help="comma-separated ways of saving for the SIGKILL scenario (default all)")
    p.add_argument("--fault-cycles", type=_store_counts, help="save/load cycles at 10%% faults, e.g. s3=100,gcs=100")
    p.add_argument("--no-outage", action="store_true", help="skip the 100%% fault runs")
    p.add_argument("--roundtrip", type=_store_counts, help="Hypothesis examples, e.g. memory=150,local=150,s3=40")
    p.add_argument("--resource-cycles", type=int, help="save/load cycles of the resources scenario")
    p.add_argument("--concurrency-seconds", type=float,
                   help="the least time the concurrency scenario's reader races the writers")
    p.add_argument("--concurrency-loads", type=int, help="the least number of loads of the concurrency scenario")
    p.add_argument("--manifest-damage", type=_store_counts,
                   help="damaged manifests and records per store, e.g. local=1000,s3=100")
    p.add_argument("--seed", type=int, default=20261201, help="seed of every random choice (default %(default)s)")
    p.add_argument("--json", type=Path, help="where to write the results (default: tests/reliability/results/)")
    p.add_argument("--keep-scratch", action="store_true", help="keep the scratch folder (printed) for inspection")
    return p


def plan(args: argparse.Namespace) -> dict:
    counts = json.loads(json.dumps(QUICK_COUNTS if args.quick else FULL_COUNTS))
    if args.trials is not None:
        n = args.trials
        counts["sigkill"] = dict.fromkeys(counts["sigkill"], n)
        counts["fault_cycles"] = dict.fromkeys(counts["fault_cycles"], n)
        counts["roundtrip"] = dict.fromkeys(counts["roundtrip"], n)
        counts["manifest_damage"] = dict.fromkeys(counts["manifest_damage"], n)
        counts["kill_after_return"] = dict.fromkeys(counts["kill_after_return"], n)
        counts["resource_cycles"] = n
        counts["concurrency_seconds"] = float(n)
        counts["concurrency_loads"] = n
    for name in ("sigkill", "fault_cycles", "roundtrip", "manifest_damage"):
        if getattr(args, name) is not None:
            counts[name] = getattr(args, name)
    if args.resource_cycles is not None:
        counts["resource_cycles"] = args.resource_cycles
    if args.concurrency_seconds is not None:
        counts["concurrency_seconds"] = args.concurrency_seconds
    if args.concurrency_loads is not None:
        counts["concurrency_loads"] = args.concurrency_loads
    if args.no_outage:
        counts["outage"] = {}
    stores = set(args.stores.split(","))
    for name in ("sigkill", "fault_cycles", "roundtrip", "outage", "manifest_damage", "kill_after_return"):
        counts[name] = {k: v for k, v in counts[name].items() if k in stores}
    counts["stores"] = sorted(stores)
    return counts


def run(args: argparse.Namespace) -> tuple[list[Result], dict]:
    from . import concurrency, credentials, faults, handover, hostile, manifests, resources, roundtrip, sigkill, suite

    counts = plan(args)
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    stores = set(counts["stores"])
    rng = random.Random(args.seed)
    scratch = Path(tempfile.mkdtemp(prefix="tp-reliability-"))
    results: list[Result] = []
    try:
        with Servers() as servers:
            for scenario in SCENARIOS:
                if scenario not in only:
                    continue
                print(f"== {scenario}", flush=True)
                sub = scratch / scenario
                sub.mkdir()
                seed = rng.randrange(2**32)
                if scenario == "sigkill":
                    modes = tuple(m for m in args.sigkill_modes.split(",") if m)
                    results += sigkill.run(servers, counts["sigkill"], random.Random(seed), sub, modes)
                elif scenario == "faults":
                    kinds = {k: (v, counts["outage"].get(k, False)) for k, v in counts["fault_cycles"].items()}
                    results += faults.run(servers, kinds, random.Random(seed), sub)
                elif scenario == "roundtrip":
                    results += roundtrip.run(servers, counts["roundtrip"], seed, sub)
                elif scenario == "secrets":
                    results += credentials.run(servers, sub, stores=tuple(
                        s for s in ("s3", "gcs", "azure", "local") if s in stores))
                elif scenario == "resources":
                    results += resources.run(servers, counts["resource_cycles"], sub, use_s3="s3" in stores)
                elif scenario == "concurrency":
                    kinds = tuple(k for k in ("local", "s3", "gcs", "azure") if k in stores)
                    results += concurrency.run(servers, kinds, counts["concurrency_seconds"],
                                               counts["concurrency_loads"], sub)
                elif scenario == "hostile":
                    results += hostile.run(sub)
                elif scenario == "manifests":
                    results += manifests.run(servers, counts["manifest_damage"], random.Random(seed), sub)
                elif scenario in suite.TIME_ROWS and not args.quick:  # make test runs their bounded tests
                    results += suite.time_row(scenario, sub)
                elif scenario == "kill-after-return":  # the full campaign also with every core busy
                    results += handover.run(servers, counts["kill_after_return"], sub,
                                            size=handover.QUICK_SIZE if args.quick else handover.FULL_SIZE,
                                            loaded=(False,) if args.quick else (False, True))
                elif scenario == "campaign" and not args.quick:  # the bounded versions are make test's own
                    results += suite.campaign(sub)
    finally:
        if args.keep_scratch:
            print(f"scratch kept at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return results, counts


def not_run(results: list[Result]) -> list[Result]:
    """Rows that should have run but could not (a server did not start): the campaign is incomplete."""
    return [r for r in results if r.skipped and any(n.startswith("not run:") for n in r.notes)]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    started = time.monotonic()
    results, counts = run(args)
    elapsed = time.monotonic() - started
    text = table(results)
    print()
    print(text)
    failures = sum(r.failures for r in results)
    print(f"\n{len(results)} rows, {sum(r.trials for r in results)} trials, {failures} failures, "
          f"{elapsed / 60:.1f} min ({'quick' if args.quick else 'full'} campaign, seed {args.seed})")
    for r in results:
        for error in r.errors:
            print(f"FAIL {r.scenario} [{r.store}]: {error}")
    path = args.json
    if path is None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = RESULTS_DIR / f"reliability-{'quick' if args.quick else 'full'}-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"quick": args.quick, "seed": args.seed, "counts": counts, "minutes": round(elapsed / 60, 2),
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()},
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "table": text,
               "results": [r.as_dict() for r in results]}
    path.write_text(json.dumps(payload, indent=2))
    print(f"results written to {path}")
    missing = not_run(results)
    if missing:
        print(f"{len(missing)} row(s) could not run: the campaign is incomplete", file=sys.stderr)
    return 1 if failures or missing else 0


if __name__ == "__main__":
    sys.exit(main())
