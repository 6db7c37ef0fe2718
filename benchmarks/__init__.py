"""taskpoint's speed benchmark (issue 3): ``python -m benchmarks --help``.

Times save and load of a checkpoint directory, a single file and a bytes payload, on local disk and on a
moto S3 server on 127.0.0.1, for taskpoint, a Flyte-style tar.gz baseline and the raw fsspec copy. Each
measured operation runs in its own subprocess, so its peak RSS is its own.
"""
