"""``python -m benchmarks`` (``make bench``): taskpoint against the Flyte-style baseline and the raw copy.

Examples::

    python -m benchmarks                                  # full size (about 1.3 GiB of data), median of 3
    python -m benchmarks --size 0.0625 --runs 1           # a quick run while developing
    python -m benchmarks --stores s3 --payloads directory --methods taskpoint,raw --profile
    python -m benchmarks --payloads directory --methods manager   # only issue 5's background saves
    python -m benchmarks --methods dcp --size 0.0625 --runs 1     # only issue 13's DCP section, 64 MiB
    python -m benchmarks --methods dedup --size 0.0625 --runs 1   # only issue 15's deduplicated steps, 64 MiB
    python -m benchmarks --methods fast --size 0.0625 --runs 1    # only issue 26's steps against Orbax/torch/copy
    python -m benchmarks --methods lightning                      # only Lightning's step time with the plug-in
    python -m benchmarks --methods subset --size 0.0625 --runs 1  # only issue 26's one file out of a step
    python -m benchmarks --methods tiers --size 0.0625 --runs 1   # only issue 24's local tier, 64 MiB
    python -m benchmarks --methods broadcast --size 0.25 --runs 3 # only issue 44's 4 ranks restoring 64 MiB
    python -m benchmarks --methods latency                        # only issue 44's small operations at 20 ms RTT
    python -m benchmarks --methods throttle                       # only issue 44's saves with 10% 503 SlowDown
    python -m benchmarks --methods async --async-sizes 64,256 --runs 5  # only issue 43's background saves
    python -m benchmarks --methods async-big --runs 3             # issue 43's 4 GiB JAX array (~16 GiB free, alone)
    python -m benchmarks --methods async-many                     # issue 43's 100 consecutive background saves
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from . import (
    _agreement,
    _async,
    _background,
    _broadcast,
    _dataset,
    _dcp,
    _dedup,
    _fast,
    _latency,
    _preemption,
    _report,
    _subset,
    _throttle,
    _tiers,
)
from ._operations import METHODS, PAYLOADS, STORES
from ._runner import REPO_ROOT, Options, run_all

BENCH_DIR = Path(__file__).resolve().parent
#: The Lightning section (--methods lightning): benchmarks/lightning_step_time.py, run in a process of its own.
LIGHTNING = "lightning"


def _choices(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)} (got {text!r})")
        return items

    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value <= 4:
        raise argparse.ArgumentTypeError("--size must be in (0, 4]")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=_positive_float, default=1.0,
                   help="scale of the data set; 1 is the issue's (1 GiB directory, 256 MiB file, 64 MiB bytes)")
    p.add_argument("--runs", type=int, default=3, help="runs per case; the median is reported (default 3)")
    p.add_argument("--baseline-runs", type=int, default=1,
                   help="runs of the slow Flyte-style baseline (default 1; never more than --runs)")
    p.add_argument("--stores", type=_choices(STORES), default=list(STORES), help="comma list: local,s3")
    p.add_argument("--payloads", type=_choices(PAYLOADS), default=list(PAYLOADS),
                   help="comma list: directory,file,bytes")
    p.add_argument("--methods", type=_choices(METHODS), default=list(METHODS),
                   help="comma list: taskpoint,taskpoint-progress,taskpoint-async,baseline,raw,raw-fsync,manager,dcp "
                   "(manager: issue 5's background saves through CheckpointManager, directory only; see "
                   "benchmarks/_background.py; dcp: issue 13's 4 ranks saving --size GiB through "
                   "torch.distributed.checkpoint, see benchmarks/_dcp.py; preemption: issue 12's signal-to-commit "
                   "time and loop cost, see benchmarks/_preemption.py; agreement: issue 28's cost per step "
                   "of agreeing on a stopping step across 4 ranks, see benchmarks/_agreement.py; dedup: issue "
                   "15's deduplicated steps of CheckpointManager against today's, see benchmarks/_dedup.py; "
                   "subset: issue 26's one file out of a step against its full restore, see benchmarks/_subset.py; "
                   "fast: issue 26's manager steps against Orbax, torch.save and a raw copy, see benchmarks/_fast.py; "
                   "tiers: issue 24's local tier against a raw local copy and S3 restores, see benchmarks/_tiers.py; "
                   "broadcast: issue 44's 4 ranks restoring one step read once, see benchmarks/_broadcast.py; "
                   "latency: issue 44's small saves and restores through a 10 ms proxy against their floor, see "
                   "benchmarks/_latency.py; throttle: issue 44's saves and restores with a tenth of the requests "
                   "answered 503 SlowDown against fault-free ones, see benchmarks/_throttle.py; "
                   "async: issue 43's background saves against DCP, Orbax and a copy, see benchmarks/_async.py; "
                   "async-big: one JAX array, Orbax against taskpoint; async-many: 100 consecutive background saves)")
    p.add_argument("--async-sizes", type=lambda text: [int(t) for t in text.split(",")], default=None,
                   help="async: the states' sizes in MiB, comma list (default: --size x 256)")
    p.add_argument("--async-kinds", type=lambda text: text.split(","), default=list(_async.METHODS),
                   help="async: the states' kinds, comma list of torch and jax (default both)")
    p.add_argument("--async-big-mib", type=int, default=4096, help="async-big: the array's size in MiB (default 4096)")
    p.add_argument("--async-many-mib", type=int, default=64, help="async-many: the state's size in MiB (default 64)")
    p.add_argument("--async-many-saves", type=int, default=_async.MANY_SAVES,
                   help=f"async-many: consecutive saves (default {_async.MANY_SAVES})")
    p.add_argument("--cases", type=_choices((*_fast.CASES, *_fast.FORMAT_CASES)), default=None,
                   help="fast and format: only these of their cases, comma list (default: all of each), e.g. "
                   "--methods format --cases verify")
    p.add_argument("--codec", default="gzip", help="taskpoint's codec (default gzip, the targets' default)")
    p.add_argument("--level", type=int, default=None, help="taskpoint's compression level (default: its own)")
    p.add_argument("--data-dir", type=Path, default=BENCH_DIR / "data", help="where the data set is built")
    p.add_argument("--results-dir", type=Path, default=BENCH_DIR / "results", help="where results are written")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds to wait before each measured operation so freed memory settles (default 2; "
                   "see benchmarks/_runner.py)")
    p.add_argument("--max-quiet-wait", type=float, default=30.0,
                   help="after --settle, wait up to this many seconds more for other processes to go quiet "
                   "(default 30)")
    p.add_argument("--stock-moto-ranges", dest="moto_fast_ranges", action="store_false",
                   help="do not patch moto's ranged GETs. By default the benchmark's moto reads only a range's "
                   "bytes, as S3, GCS and Azure do; stock moto reads the whole object for every range, which "
                   "punishes any ranged or parallel reader (see benchmarks/_s3server.py)")
    p.add_argument("--train-iterations", type=int, default=4, metavar="K",
                   help="manager: iterations of the 'training' loop, each followed by a background save (default 4)")
    p.add_argument("--train-work", choices=_background.WORKS, default="numpy",
                   help="manager: the loop's single-threaded CPU work, numpy matrix products (release the GIL) or "
                   "a pure-Python loop (holds it); default numpy")
    p.add_argument("--profile", action="store_true",
                   help="record taskpoint's workers with py-spy (threads, idle included) into RESULTS/profiles/")
    args = p.parse_args(argv)
    if args.runs < 1 or args.baseline_runs < 1:
        p.error("--runs and --baseline-runs must be at least 1")
    if args.train_iterations < 1:
        p.error("--train-iterations must be at least 1")
    return args


def _only(cases: tuple[str, ...], chosen: list[str] | None) -> tuple[str, ...]:
    """The ``cases`` of a section that ``--cases`` names (all of them without it)."""
    return cases if chosen is None else tuple(case for case in cases if case in chosen)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("taskpoint", "fsspec", "s3fs", "aiobotocore", "moto", "isal", "zstandard", "anyio", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(REPO_ROOT)
    started = time.time()
    load_before = os.getloadavg()
    # sections with data of their own
    separate = (_dcp.METHOD, _preemption.METHOD, _agreement.METHOD, _dedup.METHOD, _subset.METHOD, _fast.METHOD,
                _fast.FORMAT_METHOD, _tiers.METHOD, _broadcast.METHOD, _latency.METHOD, _throttle.METHOD, _async.METHOD,
                _async.BIG_METHOD, _async.MANY_METHOD, LIGHTNING)
    main_table = any(m not in separate for m in args.methods)
    dataset = _dataset.prepare(args.data_dir, args.size) if main_table else None
    mib = {k: v / 2**20 for k, v in dataset.sizes.items()} if dataset else {}
    if dataset:
        print(f"payloads: directory {mib['directory']:.1f} MiB ({len(dataset.files) - 2} files), "
              f"file {mib['file']:.1f} MiB, bytes {mib['bytes']:.1f} MiB; runs {args.runs} "
              f"(baseline {min(args.runs, args.baseline_runs)}); load average {load_before[0]:.2f}", flush=True)
    stem = "bench" if args.size == 1 else f"bench-size{args.size:g}"
    if not main_table:  # a section alone: never over the main table
        stem += "-" + "-".join(args.methods + (args.cases or []))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    profile_dir = None
    if args.profile:
        profile_dir = args.results_dir / "profiles" / stem
        profile_dir.mkdir(parents=True, exist_ok=True)
    # the main table runs the per-case methods only: the sections above run in their own functions below
    opts = Options(stores=args.stores, payloads=args.payloads, methods=[m for m in args.methods if m not in separate],
                   runs=args.runs,
                   baseline_runs=min(args.runs, args.baseline_runs), codec=args.codec, level=args.level,
                   work_dir=args.data_dir / "work", profile_dir=profile_dir, settle=args.settle,
                   max_quiet_wait=args.max_quiet_wait, moto_fast_ranges=args.moto_fast_ranges,
                   train_iterations=args.train_iterations, train_work=args.train_work,
                   log=lambda msg: print(msg, flush=True))
    results = run_all(dataset, opts) if dataset else []
    preempt = (_preemption.run(args.size, args.runs, args.data_dir / "work-preemption")
               if _preemption.METHOD in args.methods else None)
    agreement = (_agreement.run(args.runs, args.data_dir / "work-agreement")
                 if _agreement.METHOD in args.methods else [])
    dcp_rows = _dcp.run(args.size, opts, args.data_dir / "work-dcp") if _dcp.METHOD in args.methods else []
    dedup_rows, dedup_stored = (_dedup.run(args.size, opts, args.data_dir / "work-dedup")
                                if _dedup.METHOD in args.methods else ([], None))
    subset_rows = _subset.run(args.size, opts, args.data_dir / "work-subset") if _subset.METHOD in args.methods else []
    fast_rows = (_fast.run(args.size, opts, args.data_dir, _only(_fast.CASES, args.cases))
                 if _fast.METHOD in args.methods else [])
    format_rows = (_fast.run(args.size, opts, args.data_dir, _only(_fast.FORMAT_CASES, args.cases))
                   if _fast.FORMAT_METHOD in args.methods else [])
    tier_rows = _tiers.run(args.size, opts, args.data_dir / "work-tiers") if _tiers.METHOD in args.methods else []
    broadcast_rows = (_broadcast.run(args.size, opts, args.data_dir / "work-broadcast")
                      if _broadcast.METHOD in args.methods else [])
    latency_rows = _latency.run(args.runs) if _latency.METHOD in args.methods else []
    throttle_rows = (_throttle.run(max(args.runs, _throttle.ROUNDS)) if _throttle.METHOD in args.methods else [])
    async_rows = (_async.run(args.size, opts, args.data_dir, args.async_sizes, _async.kinds(args.async_kinds))
                  if _async.METHOD in args.methods else [])
    big_rows = (_async.run_big(opts, args.data_dir, args.async_big_mib) if _async.BIG_METHOD in args.methods
                else [])
    many_rows = (_async.run_many(opts, args.data_dir, args.async_many_mib, args.async_many_saves)
                 if _async.MANY_METHOD in args.methods else [])
    lightning = (subprocess.run([sys.executable, "-m", "benchmarks.lightning_step_time"], check=True,
                                capture_output=True, text=True).stdout.strip() if LIGHTNING in args.methods else "")
    summaries = [r.summary() for r in results]
    rows = _report.add_ratios([r for r in summaries if r["method"] != _background.METHOD])
    background = _report.add_background_ratios([r for r in summaries if r["method"] == _background.METHOD])
    goals = ((_report.targets(rows) if rows else []) + (_report.background_targets(background) if background else [])
             + _dcp.targets(dcp_rows) + _dedup.targets(dedup_rows) + _subset.targets(subset_rows)
             + _fast.targets(fast_rows) + _fast.targets(format_rows) + _async.targets(async_rows + big_rows)
             + _async.many_targets(many_rows)
             + (_tiers.targets(tier_rows) if tier_rows else []) + _broadcast.targets(broadcast_rows)
             + _throttle.targets(throttle_rows))
    directory = f" (directory {mib['directory']:.0f} MiB)" if mib else ""
    title = (f"taskpoint benchmark, size {args.size:g}{directory}, "
             f"median of {args.runs} (baseline {opts.baseline_runs}), codec {args.codec}, {os.cpu_count()} cores"
             + (", moto with fast ranges" if args.moto_fast_ranges and "s3" in args.stores else ""))
    sections = [title, ""]
    if rows:
        sections += [_report.table(rows), ""]
    if background:
        sections += [f"background saves (issue 5): CheckpointManager, directory {mib['directory']:.0f} MiB, codec "
                     f"{args.codec}, loop of K = {args.train_iterations} iterations of single-threaded "
                     f"{args.train_work} work", "", _report.background_table(background), ""]
    if dcp_rows:
        sections += [f"PyTorch DCP (issue 13): {_dcp.RANKS} gloo ranks save and load {args.size:g} GiB of sharded "
                     "float32 DTensors; x ref = time / DCP's writer on the same store (fsspec on s3, filesystem "
                     "locally); cpu s = the ranks' CPU, all threads", "", _dcp.table(dcp_rows), ""]
    if dedup_rows:
        sections += [_dedup.notes(args.size, opts), "", _dedup.table(dedup_rows, dedup_stored), ""]
    if subset_rows:
        sections += [_subset.notes(args.size), "", _subset.table(subset_rows), ""]
    if fast_rows:
        sections += [f"manager steps against the tools users pick instead (issue 26): local disk, alternating rounds, "
                     f"size {args.size:g}; x ref = time / the case's reference (orbax, torch, raw copy)", "",
                     _fast.table(fast_rows), ""]
    if format_rows:
        sections += [f"the stored format's costs (issue 42): local disk, alternating rounds, size {args.size:g}; "
                     "x ref = time / raw copy with fsync (plain save and restore: a raw copy back), reading the "
                     "bytes once (verify's load = the verify; its save row is the step's save, alike for both), DCP's "
                     "FileSystemReader (dcp)", "", _fast.table(format_rows), ""]
    if tier_rows:
        sections += [f"local tier (issue 24): CheckpointManager(local_dir=..., codec='none') on the dedup section's "
                     f"float32 files, remote tier on the {tier_rows[0]['store']} store; ratios are medians of per-run "
                     "ratios (benchmarks/_tiers.py)", "", _tiers.table(tier_rows), ""]
    if broadcast_rows:
        sections += [f"one read per step (issue 44): {_broadcast.RANKS} gloo ranks under torchrun on 2 shared cores "
                     "restore one step from moto, each way through a byte-counting proxy (benchmarks/_broadcast.py)",
                     "", _broadcast.table(broadcast_rows), ""]
    if latency_rows:
        sections += [_latency.notes(), "", _latency.table(latency_rows), ""]
    if throttle_rows:
        sections += [_throttle.notes(), "", _throttle.table(throttle_rows), ""]
    if async_rows:
        sections += ["background saves against the tools users pick instead (issue 43): local disk, each method in "
                     f"its own process, alternating order, medians of {args.runs} rounds; seconds; peak extra = PSS of "
                     "the trainer and its save process (benchmarks/_async.py)", "", _async.table(async_rows), ""]
    if big_rows:
        sections += [f"one JAX array of {args.async_big_mib} MiB (issue 43, Orbax's report): Orbax's async manager "
                     "and taskpoint's background PyTree save, each in its own process, alternating order, medians of "
                     f"{args.runs} rounds; seconds; peak extra = PSS of the trainer and its save process "
                     "(benchmarks/_async.py)", "", _async.table(big_rows), ""]
    if many_rows:
        sections += [f"{args.async_many_saves} consecutive background saves of {args.async_many_mib} MiB (issue 43): "
                     "the PSS of the trainer and of its save process in MiB, before the first save, after the "
                     "first and the tenth, and at the end (benchmarks/_async.py)", "", _async.many_table(many_rows),
                     ""]
    if lightning:
        sections += ["Lightning: a training loop's step time with a .ckpt every few steps (benchmarks/"
                     "lightning_step_time.py)", "", lightning, ""]
    if preempt:
        sections += ["preemption (issue 12): a trainer with CheckpointManager(on_preemption=...) gets SIGTERM at a "
                     "random moment; and the loop cost of the handling when no notice comes", "",
                     _preemption.table(preempt), ""]
    if agreement:
        sections += [f"preemption across ranks (issue 28): the cost per training step of the stopping-step "
                     f"agreement while no notice is pending, {_agreement.RANKS} ranks on 2 shared cores", "",
                     _agreement.table(agreement), ""]
    text = "\n".join([*sections, _report.targets_table(goals)])
    text += ("\n\ncolumns: RSS+ = peak RSS above the idle worker (plus the whole peak of taskpoint's save process, "
             "for background saves); tmp+ = peak extra temp disk; cpu s = the worker's CPU during the operation "
             "(and its save process's); srv cpu s = the S3 server's CPU; others = cores used by other processes "
             "meanwhile ('!' = busy machine, the row is less reliable); MB = 10^6 bytes")
    if background:
        text += ("\nbackground saves: committed s = from the first call until the last save was committed "
                 "(wait_until_finished returned); tmp+ = the snapshot's copy of the data; the loop's ratio is "
                 "taken when its last save call returns, its wait for that save is in committed s")
    if args.size != 1:
        text += "\n\n(scaled run: the targets are stated for size 1; RSS and ratios at other sizes are indicative)"
    print("\n" + text)
    failed = [r for r in rows + background + dcp_rows + dedup_rows + subset_rows + fast_rows + format_rows
              if r.get("error")]
    failed += [{**r, "method": _tiers.METHOD} for r in tier_rows if r.get("error")]
    if dedup_stored and dedup_stored.get("error"):
        failed.append({"store": dedup_stored["store"], "payload": "directory", "op": "stored bytes",
                       "method": _dedup.METHOD, "error": dedup_stored["error"]})
    for r in failed:
        print(f"\nERROR {r['store']}/{r.get('payload', 'dcp')}/{r['op']}/{r['method']}: {r['error']}")
    meta = {
        "argv": sys.argv, "size": args.size, "runs": args.runs, "baseline_runs": opts.baseline_runs,
        "codec": args.codec, "level": args.level, "stores": args.stores, "settle_s": args.settle,
        "moto_fast_ranges": args.moto_fast_ranges,
        "train_iterations": args.train_iterations, "train_work": args.train_work,
        "cpus": os.cpu_count(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": time.time() - started, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "git_commit": _git("rev-parse", "HEAD"), "git_dirty_src": _git("status", "--porcelain", "src"),
        "versions": _versions(),
        "dataset": {"sizes": dataset.sizes, "spec": _dataset.spec_for(args.size)} if dataset else None,
        "preemption": preempt, "agreement": agreement, "dedup_stored": dedup_stored,
        "mb": "10^6 bytes", "notes": "RSS+ is peak RSS above the idle worker (libraries imported, case prepared); "
        "tmp+ is the peak of bytes in TMPDIR, the load workspace and the local store folder minus what remains",
    }
    _report.write_json(args.results_dir / f"{stem}.json", meta,
                       rows + background + dcp_rows + dedup_rows + subset_rows + fast_rows + format_rows
                       + broadcast_rows + latency_rows + throttle_rows + async_rows + big_rows + many_rows, goals, text)
    (args.results_dir / f"{stem}.txt").write_text(text + "\n")
    try:
        if rows:  # the plot shows MB/s of saves and loads; the background saves have no such bars
            _report.plot(args.results_dir / f"{stem}.png", rows, title)
    except ImportError:
        print("(no PNG: matplotlib is not installed; pip install matplotlib)")
    print(f"\nwrote {args.results_dir / stem}.{{txt,json{',png' if rows else ''}}} in {time.time() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
