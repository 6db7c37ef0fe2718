"""Client CPU of one large S3 upload: raw boto3, s3fs, taskpoint on s3fs, obstore's fsspec adapter (issue 15 item 5).

``python -m benchmarks.s3_client_cpu --size-mib 1024 --runs 3``

moto's S3 runs in a separate process on 127.0.0.1 (``benchmarks._s3server``), so the CPU measured here
(``getrusage(RUSAGE_SELF)`` user + system, all threads of this process: s3fs's event loop, obstore's tokio
workers) is the client's alone. The payload is random bytes made once in memory. Each case uploads it to a
new key, which is deleted after the run (the taskpoint cases' first run is first loaded back and
compared with the payload, untimed; moto serves ranged GETs with ``--fast-ranges``, which only that
load uses). The median of ``--runs`` is reported, after one untimed 1 MiB upload
per case (imports, sessions and clients are made on first use). Wall time is bounded by moto's own speed;
client CPU per GiB is the figure that matters.

Cases:

* ``raw``: boto3's low-level client, one thread: create_multipart_upload, upload_part per 8 MiB part,
  complete_multipart_upload (the least client work; botocore's default checksums and signing).
* ``s3fs``: ``S3FileSystem.pipe_file`` (its own multipart upload).
* ``taskpoint-s3fs``: ``taskpoint.Checkpoint(uri, storage_options=..., codec="none").save_sync(data)``
  (taskpoint's multipart writer on s3fs, plus its CRC32 and record).
* ``obstore``: ``obstore.fsspec.FsspecStore("s3", ...)``'s ``pipe_file`` (obstore's ``put``: multipart,
  parts in parallel).
* ``obstore-open``: the same filesystem's ``open(path, "wb")`` written in 8 MiB pieces (its buffered writer,
  which is what a generic fsspec caller like taskpoint uses).
* ``taskpoint-obstore``: the taskpoint save with ``obstore.fsspec.register("s3")`` in force, so that
  ``s3://`` resolves to obstore's filesystem (taskpoint picks its backend by the filesystem's class: the
  generic one).
* ``taskpoint-obstore-backend``: the taskpoint save with ``storage_options={..., "s3_client": "obstore"}``:
  taskpoint's ``ObstoreS3Backend`` (obstore's writer, the record written with If-Match), the fast path.

``--unsigned-payload`` turns off the SHA-256 of request bodies in every client (see ``Bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ._runner import open_store

PART = 8 * 1024 * 1024
CASES = ("raw", "s3fs", "taskpoint-s3fs", "obstore", "obstore-open", "taskpoint-obstore", "taskpoint-obstore-backend")


def cpu_seconds() -> float:
    """User + system CPU of this process (every thread), in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def obstore_options(endpoint: str, options: dict[str, Any]) -> dict[str, Any]:
    """obstore's S3 configuration for the moto endpoint: the same dummy credentials and region, plain HTTP."""
    return {
        "config": {"endpoint": endpoint, "access_key_id": options["key"], "secret_access_key": options["secret"],
                   "region": options["client_kwargs"]["region_name"], "virtual_hosted_style_request": False},
        "client_options": {"allow_http": True},
    }


@contextlib.contextmanager
def s3_as_obstore() -> Iterator[None]:
    """``s3://`` resolved by fsspec to obstore's filesystem for the duration, then to s3fs again."""
    import fsspec
    import obstore.fsspec
    import s3fs

    obstore.fsspec.register("s3")
    try:
        yield
    finally:
        # The class, not its dotted name: fsspec looks in its registry of classes before the names.
        fsspec.register_implementation("s3", s3fs.S3FileSystem, clobber=True)


class Bench:
    def __init__(self, root: str, options: dict[str, Any], unsigned_payload: bool) -> None:
        import boto3
        import fsspec
        from botocore.config import Config
        from obstore.fsspec import FsspecStore

        self.root = root  # s3://bucket/bench
        self.bucket = root.removeprefix("s3://").split("/", 1)[0]
        self.endpoint = options["endpoint_url"]
        self.obstore_options = obstore_options(self.endpoint, options)
        boto_config = Config()
        if unsigned_payload:
            # What botocore does by itself over HTTPS (a checksum header, no SHA-256 of the body); over plain HTTP,
            # as here, it otherwise signs (hashes) every body. obstore hashes bodies over HTTP and HTTPS alike
            # unless told not to.
            options = {**options, "config_kwargs": {"s3": {"payload_signing_enabled": False}}}
            boto_config = Config(s3={"payload_signing_enabled": False})
            self.obstore_options["config"]["unsigned_payload"] = True
        self.options = options
        self.s3fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        self.boto = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=options["key"],
                                 aws_secret_access_key=options["secret"],
                                 region_name=options["client_kwargs"]["region_name"], config=boto_config)
        self.obstore = FsspecStore("s3", **self.obstore_options)

    def key(self, case: str) -> str:
        return f"bench/cpu/{case}-{uuid.uuid4().hex[:8]}"

    def run(self, case: str, data: bytes, verify: bool) -> tuple[float, float]:
        key = self.key(case)
        action: Callable[[], None] = getattr(self, "_" + case.replace("-", "_"))(key, data)
        wall, cpu = time.perf_counter(), cpu_seconds()
        action()
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        if verify and case.startswith("taskpoint"):
            self._load_back(case, key, data)
        self._check_and_delete(key, len(data), taskpoint=case.startswith("taskpoint"))
        return wall, cpu

    def _load_back(self, case: str, key: str, data: bytes) -> None:
        """Load the checkpoint just saved (on the same filesystem) and compare it with the payload (untimed)."""
        import taskpoint

        obstore = case == "taskpoint-obstore"
        options = (self.obstore_options if obstore else
                   {**self.options, "s3_client": "obstore"} if case == "taskpoint-obstore-backend" else self.options)
        with tempfile.TemporaryDirectory(prefix="tp-s3cpu-load-") as ws, \
                (s3_as_obstore() if obstore else contextlib.nullcontext()):
            ckpt = taskpoint.Checkpoint(f"s3://{self.bucket}/{key}-unused", f"s3://{self.bucket}/{key}",
                                        storage_options=options, workspace=ws)
            path = ckpt.load_sync(progress=False)
            assert path is not None, f"{case}: nothing loaded back"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            assert len(files) == 1 and files[0].read_bytes() == data, f"{case}: loaded back {files}, not the payload"

    def _check_and_delete(self, key: str, size: int, taskpoint: bool) -> None:
        listed = self.boto.list_objects_v2(Bucket=self.bucket, Prefix=key)
        objects = listed.get("Contents", [])
        if taskpoint:
            # The checkpoint object (the archive of the payload, a little larger) and nothing stray.
            assert any(o["Size"] >= size for o in objects), objects
        else:
            assert [o["Size"] for o in objects] == [size], objects
        for o in objects:
            self.boto.delete_object(Bucket=self.bucket, Key=o["Key"])

    # Each case returns the action to time (set-up outside the timed part).

    def _raw(self, key: str, data: bytes) -> Callable[[], None]:
        def act() -> None:
            upload = self.boto.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
            parts = []
            for number, start in enumerate(range(0, len(data), PART), 1):
                answer = self.boto.upload_part(Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=number,
                                               Body=data[start:start + PART])
                parts.append({"PartNumber": number, "ETag": answer["ETag"]})
            self.boto.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload,
                                                MultipartUpload={"Parts": parts})
        return act

    def _s3fs(self, key: str, data: bytes) -> Callable[[], None]:
        return lambda: self.s3fs.pipe_file(f"{self.bucket}/{key}", data)

    def _taskpoint_s3fs(self, key: str, data: bytes) -> Callable[[], None]:
        import taskpoint

        ckpt = taskpoint.Checkpoint(f"s3://{self.bucket}/{key}", storage_options=self.options, codec="none")
        return lambda: ckpt.save_sync(data, progress=False)

    def _obstore(self, key: str, data: bytes) -> Callable[[], None]:
        return lambda: self.obstore.pipe_file(f"s3://{self.bucket}/{key}", data)

    def _obstore_open(self, key: str, data: bytes) -> Callable[[], None]:
        view = memoryview(data)

        def act() -> None:
            with self.obstore.open(f"s3://{self.bucket}/{key}", "wb") as f:
                for start in range(0, len(data), PART):
                    f.write(view[start:start + PART])
        return act

    def _taskpoint_obstore(self, key: str, data: bytes) -> Callable[[], None]:
        import taskpoint

        with s3_as_obstore():
            ckpt = taskpoint.Checkpoint(f"s3://{self.bucket}/{key}", storage_options=self.obstore_options,
                                        codec="none")
        self.taskpoint_obstore_backend = type(ckpt._dest.backend).__name__  # which backend taskpoint chose
        self.taskpoint_obstore_fs = type(ckpt._dest.fs).__name__

        def act() -> None:
            with s3_as_obstore():  # the save opens more locations (its record) by URL
                ckpt.save_sync(data, progress=False)
        return act

    def _taskpoint_obstore_backend(self, key: str, data: bytes) -> Callable[[], None]:
        import taskpoint

        options = {**self.options, "s3_client": "obstore"}
        ckpt = taskpoint.Checkpoint(f"s3://{self.bucket}/{key}", storage_options=options, codec="none")
        assert type(ckpt._dest.backend).__name__ == "ObstoreS3Backend", ckpt._dest.backend
        return lambda: ckpt.save_sync(data, progress=False)


def table(results: dict[str, list[tuple[float, float]]], size: int, notes: dict[str, str]) -> str:
    gib = size / 2**30
    med = {c: (statistics.median(w for w, _ in r), statistics.median(c_ for _, c_ in r)) for c, r in results.items()}
    raw_cpu = med.get("raw", (0.0, 0.0))[1]
    s3fs_cpu = med.get("s3fs", (0.0, 0.0))[1]
    lines = [f"Upload of {size / 2**20:.0f} MiB of random bytes to moto S3 on 127.0.0.1 (separate process), "
             f"median of {min(len(r) for r in results.values())} runs.", "",
             "| case | wall s | MiB/s | client CPU s | CPU s per GiB | CPU vs raw | CPU vs s3fs |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for case, (wall, cpu) in med.items():
        vs_raw = f"{cpu / raw_cpu:.2f}x" if raw_cpu else "-"
        vs_s3fs = f"{cpu / s3fs_cpu:.2f}x" if s3fs_cpu else "-"
        lines.append(f"| {case} | {wall:.2f} | {size / 2**20 / wall:.0f} | {cpu:.2f} | {cpu / gib:.2f} | "
                     f"{vs_raw} | {vs_s3fs} |")
    lines += ["", *(f"- {k}: {v}" for k, v in notes.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3_client_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="upload size in MiB (default 1024)")
    p.add_argument("--runs", type=int, default=3, help="runs per case; the median is reported (default 3)")
    p.add_argument("--unsigned-payload", action="store_true",
                   help="no SHA-256 of request bodies in any client (botocore's own choice over HTTPS; moto is HTTP)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {','.join(CASES)}")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown or args.size_mib <= 0 or args.runs <= 0:
        p.error(f"bad --cases {sorted(unknown)} or non-positive --size-mib/--runs")
    size = args.size_mib * 2**20
    data = os.urandom(size)
    results: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="tp-s3cpu-") as work, \
            open_store("s3", Path(work), lambda m: print(m, file=sys.stderr), fast_ranges=True) as store:
        bench = Bench(store.root, store.storage_options, args.unsigned_payload)
        for case in cases:  # untimed warm-up: imports, sessions and clients are made on first use
            bench.run(case, data[:2**20], verify=False)
        for run in range(args.runs):
            for case in cases:  # interleaved, so that drift on the shared machine hits every case alike
                wall, cpu = bench.run(case, data, verify=run == 0)
                results[case].append((wall, cpu))
                print(f"run {run + 1} {case}: wall {wall:.2f} s, cpu {cpu:.2f} s", file=sys.stderr, flush=True)
        if "taskpoint-obstore" in cases:
            notes["taskpoint-obstore"] = (f"s3:// resolved to {bench.taskpoint_obstore_fs}; taskpoint chose "
                                          f"{bench.taskpoint_obstore_backend}")
    import botocore
    import obstore
    import s3fs

    notes["versions"] = (f"python {sys.version.split()[0]}, botocore {botocore.__version__}, "
                         f"s3fs {s3fs.__version__}, obstore {obstore.__version__}, {os.cpu_count()} CPUs")
    notes["payload signing"] = ("off in every client (--unsigned-payload)" if args.unsigned_payload else
                                "the clients' defaults over HTTP: botocore and obstore both SHA-256 every body")
    print(table(results, size, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
