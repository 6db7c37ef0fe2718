"""Throttling absorbed (issue 44 item 1): 503 SlowDown, 429 and ``Retry-After`` answered by the project's fault
proxy in front of real servers (moto for S3, through s3fs and obstore; the GCS emulator through gcsfs).

A store that throttles some requests costs retries, never a save or the bytes of a restore, and the save's
log record counts the throttling answers (also those the client retried itself: Azure's SDK its 503s, heard and
paced by taskpoint; obstore none of a whole operation's, so that they reach the retry policy); a store that
throttles every request ends the operation with StorageUnavailable naming the store, the previous step intact; a
``Retry-After`` is waited out; and the cap on requests in flight falls while a store pushes back.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from _fault_proxy import fault_proxy
from _servers import azure_storage_options
from taskpoint import CheckpointManager, RetryPolicy, StorageUnavailable, TransferStats
from taskpoint.executors import IO
from taskpoint.storage import Location
from taskpoint.storage.throttle import MAX_IN_FLIGHT, Pushback, parse_retry_after, retry_after, throttled

#: Bound of every wait on a thread in these tests (seconds): far past any deadline they set.
WAIT_BOUND = 300.0
#: The short retry deadline of the tests where every request is throttled (seconds).
SHORT_DEADLINE = 4.0


@pytest.fixture
def records() -> Iterator[list[TransferStats]]:
    """The figures of each save and load logged while the test runs."""
    found: list[TransferStats] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            stats = getattr(record, "transfer", None)
            if isinstance(stats, TransferStats):
                found.append(stats)

    logger = logging.getLogger("taskpoint")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


#: What each store answers when it throttles: S3 503 SlowDown, GCS and Azure 429 Too Many Requests.
_STATUS = {"s3": "503", "s3-obstore": "503", "gcs": "429", "azure": "429"}
#: The server fixture and the URL scheme of each store.
_SERVER = {"s3": "s3_server", "s3-obstore": "s3_server", "gcs": "gcs_server", "azure": "azure_server"}
_SCHEME = {"s3": "s3", "s3-obstore": "s3", "gcs": "gs", "azure": "az"}


def _server(request: pytest.FixtureRequest, kind: str) -> Any:
    return request.getfixturevalue(_SERVER[kind])


def _options(server: Any, kind: str, proxy_url: str) -> dict[str, Any]:
    """The server's storage options, with the proxy in the place of the server."""
    if kind == "azure":
        return azure_storage_options(proxy_url)
    options = {**server.storage_options, "endpoint_url": proxy_url}
    if kind == "s3-obstore":
        options["s3_client"] = "obstore"
    return options


def _url(server: Any, kind: str) -> str:
    return f"{_SCHEME[kind]}://{server.bucket}/throttled-{uuid.uuid4().hex}"


def _bounded(fn: Any) -> BaseException | None:
    """Run ``fn`` in a thread, waiting at most :data:`WAIT_BOUND`; the exception it raised, None if none."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_BOUND)
    assert not thread.is_alive(), f"still running after {WAIT_BOUND} s"
    return raised[0] if raised else None


#: GCS and Azure run the tenth-throttled test in make reliability; make test throttles them in the two tests below.
_ELSEWHERE_TOO = pytest.mark.campaign("a tenth throttled on GCS and Azure too (make test: S3, both clients)")


@pytest.mark.parametrize("kind", ["s3", "s3-obstore", pytest.param("gcs", marks=_ELSEWHERE_TOO),
                                  pytest.param("azure", marks=_ELSEWHERE_TOO)])
def test_a_tenth_of_requests_throttled_every_save_commits_and_restores_its_bytes(request, kind, records):
    server = _server(request, kind)
    url = _url(server, kind)
    status = _STATUS[kind]
    with fault_proxy(server.endpoint, seed=44, rate=0.1, kinds=(status,)) as proxy:
        options = _options(server, kind, proxy.url)
        manager = CheckpointManager(url, storage_options=options)
        payloads = {step: f"step {step} ".encode() * (step + 10) for step in range(10)}
        for step, data in payloads.items():
            manager.save(data, step)
        for step, data in payloads.items():
            assert manager.restore(step=step).read_bytes() == data
        injected = proxy.stats()[status]
    assert injected > 0, "the proxy throttled nothing: the test tested nothing"
    assert [r.step for r in records if r.operation == "save"] == list(payloads)
    in_records = sum(r.throttled for r in records)  # a restore's lease is let go after its record
    store_count = Location(url, options).throttles()  # every location of the store counts into one figure
    assert in_records <= store_count
    # Under obstore only the answers to s3fs are seen (below), and its small saves and restores make none inside
    # their records since issue 44 item 3 (no HEAD after the PUT): its records may count nothing.
    assert in_records > 0 or kind == "s3-obstore"
    if kind in ("s3", "gcs"):  # botocore's and gcsfs's answers are watched: every throttling answer is counted
        assert store_count == injected
    else:  # obstore's and Azure's own retries are not seen: only what they give up on (and, under obstore, the
        assert store_count <= injected  # answers to s3fs: listings, checks)


def test_the_log_line_of_a_throttled_save_says_how_many_answers_were_retried(s3_server, records, caplog):
    with fault_proxy(s3_server.endpoint, seed=1, rate=0.0, kinds=("503",)) as proxy:
        manager = CheckpointManager(_url(s3_server, "s3"), storage_options=_options(s3_server, "s3", proxy.url))
        let_up = threading.Event()

        def let_up_after_two() -> None:  # the store throttles two answers, then lets up
            for _ in range(int(WAIT_BOUND / 0.01)):
                if proxy.stats()["503"] >= 2:
                    break
                let_up.wait(0.01)
            proxy.rate = 0.0
            let_up.set()

        proxy.rate = 1.0
        watcher = threading.Thread(target=let_up_after_two, daemon=True)
        watcher.start()
        with caplog.at_level(logging.INFO, logger="taskpoint"):
            manager.save(b"payload", 1)
        assert let_up.wait(WAIT_BOUND)
        watcher.join(WAIT_BOUND)
    saved = [r for r in records if r.operation == "save"]
    assert saved[-1].throttled >= 2
    assert f"{saved[-1].throttled} throttled answers retried" in caplog.text


@pytest.mark.parametrize("kind", ["s3", "s3-obstore", pytest.param("gcs", marks=pytest.mark.campaign(
    "every request throttled on GCS too (34 s of gcsfs's own retries; make test: S3 with both clients, Azure)")),
    "azure"])
def test_a_store_that_throttles_every_request_ends_with_storage_unavailable_naming_it(request, kind):
    server = _server(request, kind)
    status = _STATUS[kind]
    with fault_proxy(server.endpoint, seed=2, rate=0.0, kinds=(status,)) as proxy:
        options = _options(server, kind, proxy.url)
        url = _url(server, kind)
        # The good step under the default deadline: on a busy machine a fault-free save can outlast the short one.
        CheckpointManager(url, storage_options=options).save(b"the good step", 1)
        manager = CheckpointManager(url, storage_options=options, retry=RetryPolicy(deadline=SHORT_DEADLINE))
        proxy.rate = 1.0
        error = _bounded(lambda: manager.save(b"never stored", 2))
        assert isinstance(error, StorageUnavailable), error
        assert proxy.stats()[status] > 0
        assert f"127.0.0.1:{proxy.port}" in str(error)
        assert "throttling" in str(error)
        assert Location(url, options).backend.pushback.cap(4) < 4  # fewer requests in flight there, meanwhile
        proxy.rate = 0.0
        assert CheckpointManager(url, storage_options=options).restore().read_bytes() == b"the good step"


@pytest.mark.parametrize("kind", ["s3", "azure"])  # botocore's retries of a request; the retry policy's (Azure)
def test_a_retry_after_is_waited_out_before_the_request_is_sent_again(request, kind, records):
    server, status, asked = _server(request, kind), _STATUS[kind], 1.0
    with fault_proxy(server.endpoint, seed=7, rate=0.25, kinds=(status,), retry_after=asked) as proxy:
        manager = CheckpointManager(_url(server, kind), storage_options=_options(server, kind, proxy.url))
        for step in range(6):
            manager.save(f"step {step}".encode(), step)
        retried = proxy.retried(status)
        injected = proxy.stats()[status]
    for method, path, after in retried:
        assert after >= asked, f"{method} {path} was sent again {after:.3f} s after a 503 that asked for {asked} s"
    assert retried, "no throttled request was retried: the test tested nothing"
    assert 0 < sum(r.throttled for r in records) <= injected


def test_the_requests_in_flight_are_halved_by_each_throttling_answer_and_grow_back_with_those_that_pass():
    pushback = Pushback("test://store")
    assert pushback.cap(4) == 4 and pushback.cap(64) == MAX_IN_FLIGHT
    pushback.throttle()
    assert pushback.throttled == 1
    assert pushback.cap(64) == MAX_IN_FLIGHT // 2
    for _ in range(3):
        pushback.throttle()
    assert pushback.cap(64) == 1
    for _ in range(100):
        pushback.answered()
    assert pushback.cap(64) == MAX_IN_FLIGHT


def test_a_lane_runs_no_more_tasks_at_once_than_its_cap_allows():
    running, most, lock = [0], [0], threading.Lock()
    release = threading.Event()

    def task() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(WAIT_BOUND)
        with lock:
            running[0] -= 1

    cap = [2]
    with IO.lane(6, lambda width: min(width, cap[0])) as lane:
        futures = [lane.submit(task) for _ in range(6)]
        threading.Event().wait(0.2)
        with lock:
            assert running[0] == 2
        release.set()
        for future in futures:
            future.result(timeout=WAIT_BOUND)
    assert most[0] == 2


def test_throttling_answers_are_told_apart_with_their_retry_after():
    from botocore.exceptions import ClientError

    slow_down = ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                             "ResponseMetadata": {"HTTPStatusCode": 503, "HTTPHeaders": {"retry-after": "3"}}},
                            "PutObject")
    too_many = ClientError({"Error": {"Code": "Whatever"}, "ResponseMetadata": {"HTTPStatusCode": 429}}, "GetObject")
    failing = ClientError({"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}},
                          "GetObject")
    wrapped = OSError("s3fs wraps it")
    wrapped.__cause__ = slow_down
    assert throttled(slow_down) and throttled(too_many) and throttled(wrapped)
    assert not throttled(failing)
    assert retry_after(wrapped) == 3.0
    assert retry_after(too_many) is None
    obstore_text = OSError("Generic S3 error: Error performing PUT http://127.0.0.1/x in 1s - Server returned "
                           "non-2xx status code: 503 Service Unavailable: <Error><Code>SlowDown</Code></Error>")
    assert throttled(obstore_text)
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert parse_retry_after("soon") is None


class FirstTryThrottled:
    """Answers 503 to the first try of each write (PUT) of a step's objects (not a restore's lease), letting every
    retry through: every save meets throttling, and every throttled request is sent again."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, method: str, path: str) -> str | None:
        if method != "PUT" or "/ckpt-" not in path or "/restore-" in path or path in self.seen:
            return None
        self.seen.add(path)
        return "503"


@pytest.mark.parametrize("kind", ["azure", "s3-obstore"])
def test_503s_a_client_retries_itself_are_counted_in_the_records_of_the_saves_they_slowed(request, kind, records):
    """Azure's SDK retries a 503 itself: each answer is heard, and the retry waits out the ``Retry-After`` (the
    SDK's own pause is 15 s whatever was asked). obstore retries none of a whole operation's requests itself (a
    record, a small object), so each 503 reaches the retry policy, which counts it; obstore's errors carry no
    header, so there the ``Retry-After`` is not known."""
    server, asked = _server(request, kind), 1.0
    with fault_proxy(server.endpoint, retry_after=asked) as proxy:
        options, url = _options(server, kind, proxy.url), _url(server, kind)
        before = Location(url, options).throttles()
        proxy.choose = FirstTryThrottled()
        manager = CheckpointManager(url, storage_options=options, preemption=False, background_process=False)
        for step in range(3):
            manager.save(f"step {step} ".encode() * 10, step)
        for step in range(3):
            assert manager.restore(step=step).read_bytes() == f"step {step} ".encode() * 10
        injected, retried = proxy.stats()["503"], proxy.retried("503")
        counted = Location(url, options).throttles() - before
    assert injected >= 3, "the proxy throttled too little: the test tested nothing"
    assert len(retried) == injected  # each one sent again
    if kind == "azure":  # by the SDK, no sooner than it asked
        for method, path, after in retried:
            assert after >= asked, f"{method} {path} was sent again {after:.3f} s after a 503 that asked for {asked} s"
    assert counted == injected  # every answer heard, none counted twice, none retried unseen
    saves = [r.throttled for r in records if r.operation == "save"]
    assert sum(saves) == injected and len(saves) == 3 and min(saves) >= 1, saves  # each in the save it slowed
