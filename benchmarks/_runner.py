"""Runs every case, each save and load in its own worker process, and collects the measurements.

Per case run the runner: deletes the case's objects, syncs the disks (so one case's write-back does not
slow the next), waits ``settle`` seconds (see below), starts the worker with a private empty ``TMPDIR``,
and watches the bytes in that ``TMPDIR``, in the load workspace and, for a local save, in the case's
store folder. Peak extra temp disk is the peak of those bytes minus what is left when the worker has
exited (the saved object or the loaded result), so the operation's own output is never counted as temp.

Why the wait: this machine is a VM with free page reporting (virtio-balloon). About 2 s after memory is
freed (a deleted file's page cache, an exited worker), the guest hands it back to the host, and the next
large allocation is slow: a 16 MiB ``write()`` into new page cache then runs at ~0.4 GB/s instead of
~4 GB/s (1 MiB writes ~1.1 GB/s; 128 KiB writes and the kernel's own copies, ``shutil.copyfile``, are
unaffected). Without the wait a case is fast or slow depending on how long ago the previous one freed its
output; with it, every case starts from the same settled ("cold") state, the one a real save meets after
the machine was busy with something else for a few seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import _background
from ._dataset import Dataset
from ._operations import Case, applies

REPO_ROOT = Path(__file__).resolve().parent.parent
#: How often the temp-disk watcher scans its folders (less often when a scan is slow).
DISK_SAMPLE_SECONDS = 0.01
#: A worker taking longer than this is stopped and reported as failed.
WORKER_TIMEOUT_SECONDS = 900
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Cores of CPU that other processes (other people's test suites) may use before the machine counts as busy.
BUSY_CORES = 0.25


@dataclass
class Options:
    stores: list[str]
    payloads: list[str]
    methods: list[str]
    runs: int
    baseline_runs: int
    codec: str
    level: int | None
    work_dir: Path
    profile_dir: Path | None = None
    settle: float = 2.0
    max_quiet_wait: float = 30.0
    moto_fast_ranges: bool = False
    train_iterations: int = 4
    train_work: str = "numpy"
    log: Any = print


@dataclass
class CaseResult:
    """All runs of one (store, payload, op, method), and their summary."""

    store: str
    payload: str
    op: str
    method: str
    logical_bytes: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def ok_runs(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if "seconds" in r]

    def summary(self) -> dict[str, Any]:
        ok = self.ok_runs
        out: dict[str, Any] = {"store": self.store, "payload": self.payload, "op": self.op, "method": self.method,
                               "logical_bytes": self.logical_bytes, "runs": len(ok), "error": self.error}
        if not ok:
            return out
        seconds = statistics.median(r["seconds"] for r in ok)
        out.update(
            seconds=seconds,
            seconds_all=[r["seconds"] for r in ok],
            mb_per_s=self.logical_bytes / seconds / 1e6,
            cpu_s=statistics.median(r["cpu_user_s"] + r["cpu_system_s"] + r.get("helper_cpu_s", 0.0) for r in ok),
            server_cpu_s=statistics.median(r.get("server_cpu_s", 0.0) for r in ok),
            rss_extra_bytes=max(r["rss_extra_bytes"] for r in ok),
            rss_idle_bytes=statistics.median(r["rss_idle_bytes"] for r in ok),
            temp_extra_bytes=max(r["temp_extra_bytes"] for r in ok),
            other_cores=max(r.get("other_cores", 0.0) for r in ok),
        )
        for key in ("stored_bytes", "loaded_bytes"):
            if key in ok[-1]:
                out[key] = ok[-1][key]
        if self.method == _background.METHOD:
            for key in _MANAGER_MEDIANS:
                values = [r[key] for r in ok if key in r]
                if values:
                    out[key] = statistics.median(values)
            out["work"] = ok[-1].get("work")
            out["run_details"] = [{k: v for k, v in r.items() if k not in _RUN_KEYS_IN_SUMMARY} for r in ok]
        return out


#: Measurements of the manager's runs (benchmarks/_background.py) summarised by their median.
_MANAGER_MEDIANS = ("total_seconds", "compute_seconds", "save_call_seconds", "drain_seconds", "work_units",
                    "iterations", "iteration_target_seconds", "work_thread_cpu_seconds", "work_thread_wait_seconds",
                    "helper_cpu_s", "helper_loop_cpu_seconds", "upload_beside_work_seconds",
                    "other_threads_cpu_seconds")
#: What the summary already holds, left out of a manager row's per-run details.
_RUN_KEYS_IN_SUMMARY = ("rss_idle_bytes", "rss_peak_bytes")


class DiskWatch:
    """Peak bytes of regular files below some folders, sampled in a thread, minus the bytes left at the end."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders = folders
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="disk-watch")

    def __enter__(self) -> DiskWatch:
        self.start = self._scan()
        self.peak = self.start
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.final = self._scan()
        self.peak = max(self.peak, self.final)

    @property
    def extra(self) -> int:
        return max(0, self.peak - max(self.final, self.start))

    def _loop(self) -> None:
        pause = DISK_SAMPLE_SECONDS
        while not self._stop.wait(pause):
            t0 = time.perf_counter()
            self.peak = max(self.peak, self._scan())
            pause = max(DISK_SAMPLE_SECONDS, 4 * (time.perf_counter() - t0))  # at most ~20% of a core

    def _scan(self) -> int:
        total = 0
        stack = [str(f) for f in self.folders]
        while stack:
            folder = stack.pop()
            try:
                with os.scandir(folder) as it:
                    for entry in it:
                        try:
                            if entry.is_dir(follow_symlinks=False):
                                stack.append(entry.path)
                            elif entry.is_file(follow_symlinks=False):
                                total += entry.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:
                            pass
            except (FileNotFoundError, NotADirectoryError):
                pass
        return total


def _py_spy() -> str:
    """py-spy beside this interpreter (a venv's bin is often not on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise RuntimeError("--profile needs py-spy: pip install py-spy")
    return found


class OtherLoad:
    """CPU seconds used on this machine by processes other than the benchmark's own (runner, workers, server)."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self._mark = self._read()

    def _read(self) -> tuple[float, float]:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
        busy = (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS
        own = sum(getattr(resource.getrusage(w), a) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for a in ("ru_utime", "ru_stime"))
        return time.monotonic(), busy - own - _process_cpu_seconds(self.server_pid)

    def cores_since_mark(self, reset: bool = True) -> float:
        """Average cores other processes used since the last mark."""
        (t0, o0), (t1, o1) = self._mark, self._read()
        if reset:
            self._mark = (t1, o1)
        return max(0.0, (o1 - o0) / max(t1 - t0, 1e-6))


def _process_cpu_seconds(pid: int | None) -> float:
    stat = None if pid is None else _background.process_stat(pid)
    return 0.0 if stat is None else stat[1]


# -- stores --------------------------------------------------------------------------------------------


@dataclass
class Store:
    """Where one store's case prefixes live, and how to empty one."""

    kind: str
    root: str
    storage_options: dict[str, Any]
    server_pid: int | None = None
    fs: Any = None

    def prefix(self, method: str, payload: str) -> str:
        return f"{self.root}/{method}/{payload}"

    def stored_bytes(self, uri: str) -> int:
        """Bytes of every object under ``uri`` (files under the folder, locally)."""
        if self.kind == "local":
            return sum(p.stat().st_size for p in Path(uri).rglob("*") if p.is_file())
        self.fs.invalidate_cache()
        return int(self.fs.du(uri))

    def clear(self, prefix: str) -> None:
        if self.kind == "local":
            shutil.rmtree(prefix, ignore_errors=True)
            os.makedirs(prefix)
        else:
            self.fs.invalidate_cache()
            if self.fs.exists(prefix):
                self.fs.rm(prefix, recursive=True)
            self.fs.invalidate_cache()


@contextlib.contextmanager
def open_store(kind: str, work: Path, log: Any, fast_ranges: bool = False) -> Iterator[Store]:
    if kind == "local":
        root = work / "store"
        root.mkdir(parents=True, exist_ok=True)
        try:
            yield Store("local", str(root), {})
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    if kind != "s3":
        raise ValueError(f"unknown store {kind!r}; the benchmark knows local and s3")
    import fsspec

    server_tmp = work / "moto-tmp"  # moto spools large objects to disk: keep them out of the cases' TMPDIR
    server_tmp.mkdir(parents=True, exist_ok=True)
    env = _environment(server_tmp)
    argv = [sys.executable, "-m", "benchmarks._s3server", *(["--fast-ranges"] if fast_ranges else [])]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the moto S3 server did not start (see its output above)")
        info = json.loads(line)
        log(f"s3: moto on {info['endpoint']} (pid {proc.pid}; ranged GETs "
            f"{'read only their bytes (--moto-fast-ranges)' if fast_ranges else 'read the whole object (stock moto)'})")
        options = info["storage_options"]
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        yield Store("s3", f"s3://{info['bucket']}/bench", options, proc.pid, fs)
    finally:
        if proc.stdin:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(server_tmp, ignore_errors=True)


def _environment(tmpdir: Path) -> dict[str, str]:
    from ._s3server import load_test_servers

    env = dict(os.environ)
    for name, value in load_test_servers().DEFAULT_ENVIRONMENT.items():
        env.setdefault(name, value)
    for name in ("NO_PROXY", "no_proxy"):
        entries = [e for e in env.get(name, "").split(",") if e]
        env[name] = ",".join([*entries, "127.0.0.1", "localhost"])
    env["TMPDIR"] = str(tmpdir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


# -- running -------------------------------------------------------------------------------------------


def run_all(dataset: Dataset, opts: Options) -> list[CaseResult]:
    work = opts.work_dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results: list[CaseResult] = []
    try:
        for kind in opts.stores:
            with open_store(kind, work, opts.log, opts.moto_fast_ranges) as store:
                for payload in opts.payloads:
                    for method in opts.methods:
                        if applies(method, payload, kind):
                            results.extend(_run_method(store, dataset, payload, method, opts))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def _run_method(store: Store, dataset: Dataset, payload: str, method: str, opts: Options) -> list[CaseResult]:
    if method == _background.METHOD:
        return _run_manager(store, dataset, payload, opts)
    logical = dataset.sizes[payload]
    save = CaseResult(store.kind, payload, "save", method, logical)
    load = CaseResult(store.kind, payload, "load", method, logical)
    prefix = store.prefix(method, payload)
    n = opts.baseline_runs if method == "baseline" else opts.runs
    for i in range(n):
        store.clear(prefix)
        case = Case(method=method, payload=payload, op="save", store=store.kind, source=str(dataset.source(payload)),
                    prefix=prefix, workspace="", storage_options=store.storage_options, codec=opts.codec,
                    level=opts.level)
        _run_once(save, case, store, opts, f"{i + 1}/{n}")
        if save.error:
            break
        workspace = opts.work_dir / "workspace"
        shutil.rmtree(workspace, ignore_errors=True)
        workspace.mkdir()
        case.op, case.workspace = "load", str(workspace)
        _run_once(load, case, store, opts, f"{i + 1}/{n}")
        if load.ok_runs and load.ok_runs[-1]["loaded_bytes"] != logical and not load.error:
            load.error = f"loaded {load.ok_runs[-1]['loaded_bytes']} bytes, expected {logical}"
        shutil.rmtree(workspace, ignore_errors=True)
        if load.error:
            break
    store.clear(prefix)
    return [save, load]


def _run_manager(store: Store, dataset: Dataset, payload: str, opts: Options) -> list[CaseResult]:
    """Issue 5's background saves: per run a blocking save, a background save, then the "training" loop
    without and with a background save per iteration. The loop's work is calibrated in the first run to
    last one blocking save per iteration; later runs repeat the same work."""
    method = _background.METHOD
    logical = dataset.sizes[payload]
    results = {op: CaseResult(store.kind, payload, op, method, logical) for op in _background.OPS}
    prefix = store.prefix(method, payload)
    units, target = 0, 0.0  # the loop's work per iteration, calibrated once to ``target`` seconds
    paced_units = 0  # the paced loops' work per iteration, calibrated once to one background save
    for i in range(opts.runs):
        label = f"{i + 1}/{opts.runs}"
        for op in _background.OPS:
            result = results[op]
            if op in ("train", "train-bg") and not units:
                blocking = results["save"].ok_runs
                if not blocking:
                    break
                target = statistics.median(r["seconds"] for r in blocking)
            store.clear(prefix)
            case = Case(method=method, payload=payload, op=op, store=store.kind, source=str(dataset.source(payload)),
                        prefix=prefix, workspace="", storage_options=store.storage_options, codec=opts.codec,
                        level=opts.level, iterations=opts.train_iterations if op.startswith("train") else 0,
                        work=opts.train_work, work_units=paced_units if op.endswith("paced") else units,
                        iteration_seconds=target if op.startswith("train") else 0.0)
            _run_once(result, case, store, opts, label)
            if result.error:
                break
            if op == "train" and not units:
                units = result.ok_runs[-1]["work_units"]
            if op == "train-bg-paced" and not paced_units:
                paced_units = result.ok_runs[-1]["work_units"]
        if any(r.error for r in results.values()):
            break
    store.clear(prefix)
    return list(results.values())


def _settle(store: Store, opts: Options) -> float:
    """Flush the dirty pages of earlier cases (``sync``: the kernel throttles a writer once everyone's dirty pages
    pass its limits, so a case would pay for its predecessors' writeback), wait ``opts.settle`` seconds, then on
    until other processes use under BUSY_CORES (at most ``opts.max_quiet_wait`` seconds more); return the seconds
    waited."""
    start = time.monotonic()
    os.sync()
    others = OtherLoad(store.server_pid)
    time.sleep(opts.settle)
    busy = others.cores_since_mark()
    while busy > BUSY_CORES and time.monotonic() - start < opts.settle + opts.max_quiet_wait:
        time.sleep(1.0)
        busy = others.cores_since_mark()
    return time.monotonic() - start


def _run_once(result: CaseResult, case: Case, store: Store, opts: Options, label: str) -> None:
    work = opts.work_dir
    tmpdir = work / "tmp"
    shutil.rmtree(tmpdir, ignore_errors=True)
    tmpdir.mkdir()
    spec_path, result_path = work / "case.json", work / "result.json"
    spec_path.write_text(json.dumps(asdict(case)))
    result_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "benchmarks._worker", str(spec_path), str(result_path)]
    name = f"{case.store}-{case.payload}-{case.op}-{case.method}"
    profile = None
    if opts.profile_dir is not None and (case.method.startswith("taskpoint") or case.method == _background.METHOD):
        profile = opts.profile_dir / f"{name}.txt"
        argv = [_py_spy(), "record", "--format", "raw", "--rate", "200", "--threads",
                "--idle", "--nonblocking", "--output", str(profile), "--", *argv]
    watched = [tmpdir]
    if case.op == "load":
        watched.append(Path(case.workspace))
    elif case.store == "local" and not case.op.startswith("train"):
        watched.append(Path(case.prefix))  # (the loop keeps older steps by retention: not temp, not watched)
    os.sync()
    waited = _settle(store, opts)
    server_cpu0 = _process_cpu_seconds(store.server_pid)
    others = OtherLoad(store.server_pid)
    env = _environment(tmpdir)
    if case.method == _background.METHOD:
        env.update(_background.ENVIRONMENT)  # one BLAS thread: the "training" work uses one core
    with DiskWatch(watched) as disk:
        proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_SECONDS, check=False)
    server_cpu = _process_cpu_seconds(store.server_pid) - server_cpu0
    other_cores = others.cores_since_mark()
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-15:])
        result.error = f"worker failed (exit {proc.returncode}): {tail}"
        opts.log(f"  {name:<40} run {label}: FAILED\n{tail}")
        return
    run = json.loads(result_path.read_text())
    if profile is not None and profile.exists():
        from ._profiles import summarize

        profile.with_suffix(".top.txt").write_text(summarize(profile) + "\n")
        run["profile"] = str(profile)
    run["temp_extra_bytes"] = disk.extra
    run["server_cpu_s"] = server_cpu
    run["loadavg_1m"] = os.getloadavg()[0]
    run["other_cores"] = other_cores
    run["waited_for_quiet_s"] = waited
    result.runs.append(run)
    mbps = result.logical_bytes / run["seconds"] / 1e6
    note = f" (waited {waited:.0f} s for quiet)" if waited > opts.settle + 1 else ""
    if case.method == _background.METHOD:
        note += _background_note(run)
    opts.log(f"  {name:<40} run {label}: {run['seconds']:8.3f} s  {mbps:8.1f} MB/s  "
             f"rss +{run['rss_extra_bytes'] / 2**20:6.1f} MiB  temp +{disk.extra / 2**20:6.1f} MiB  "
             f"others {other_cores:.2f} cores{note}")
    shutil.rmtree(tmpdir, ignore_errors=True)


def _background_note(run: dict[str, Any]) -> str:
    """The progress line's details of a manager run: until committed, and where a loop spent its time."""
    parts = []
    if "work_units" in run:
        parts.append(f"{run['work_units']} units of {run['work']} work per iteration"
                     + (" (calibrated)" if run.get("calibrated") else ""))
    if "compute_seconds" in run:
        parts.append(f"compute {run['compute_seconds']:.2f} s")
    if "save_call_seconds" in run:
        parts.append(f"save calls {run['save_call_seconds']:.2f} s")
    if "work_thread_wait_seconds" in run:
        parts.append(f"work thread waited {run['work_thread_wait_seconds']:.2f} s for a core")
    if "upload_beside_work_seconds" in run:
        parts.append(f"one background save beside the work took {run['upload_beside_work_seconds']:.2f} s")
    if run.get("other_threads_cpu_seconds", 0) > 0.05:
        parts.append(f"save threads' cpu {run['other_threads_cpu_seconds']:.2f} s")
    if run.get("helper_loop_cpu_seconds", 0) > 0.05:
        parts.append(f"save process cpu {run['helper_loop_cpu_seconds']:.2f} s")
    if "total_seconds" in run:
        parts.append(f"until committed {run['total_seconds']:.2f} s")
    return f"  [{'; '.join(parts)}]" if parts else ""
