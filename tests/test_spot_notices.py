"""Issue 12: polling a cloud's spot or preemption notice. The clouds' metadata services are played by a small HTTP
server of the test's own on 127.0.0.1 that answers as each documents it (a protocol, not a mock of our code):
EC2's IMDSv2 token and ``spot/instance-action``, GCE's ``instance/preempted``, Azure's scheduled events."""

from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest

import taskpoint
from helpers import wait_until
from taskpoint import preemption

STOP_AT = time.time() + 120


class Cloud(http.server.ThreadingHTTPServer):
    """One cloud's metadata service: no notice until :attr:`noticed` is set."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Answers)
        self.noticed = False
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Answers(http.server.BaseHTTPRequestHandler):
    server: Cloud

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        self.server.requests.append(("PUT", self.path, dict(self.headers)))
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._answer(200, b"token-123")
        self._answer(400)

    def do_GET(self) -> None:
        self.server.requests.append(("GET", self.path, dict(self.headers)))
        noticed = self.server.noticed
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "token-123":
                return self._answer(401)
            if not noticed:
                return self._answer(404)
            when = datetime.fromtimestamp(STOP_AT, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            return self._answer(200, json.dumps({"action": "terminate", "time": when}).encode())
        if self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._answer(403)
            return self._answer(200, b"TRUE" if noticed else b"FALSE")
        if self.path.startswith("/metadata/scheduledevents"):
            if self.headers.get("Metadata") != "true":
                return self._answer(400)
            events = [{"EventId": "e1", "EventType": "Freeze", "NotBefore": ""}]
            if noticed:
                events.append({"EventId": "e2", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                               "NotBefore": format_datetime(datetime.fromtimestamp(STOP_AT, timezone.utc),
                                                            usegmt=True)})
            return self._answer(200, json.dumps({"DocumentIncarnation": 1, "Events": events}).encode())
        self._answer(404)


@pytest.fixture
def cloud() -> Iterator[Cloud]:
    server = Cloud()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fresh() -> Iterator[None]:
    preemption.clear()
    yield
    preemption.clear()


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_a_polled_notice_is_recorded_with_the_stop_time_the_cloud_gives(provider, cloud, fresh):
    poller = preemption.NoticePoller(provider, url=cloud.url, interval=0.05)
    assert poller.check() is None and preemption.notice() is None  # no notice yet: nothing recorded
    cloud.noticed = True
    notice = poller.check()
    assert notice is not None and preemption.notice() is notice and notice.name == "SIGTERM"
    if provider == "gcp":  # GCE gives no time: the grace period applies (about 30 s on GCE too)
        assert notice.deadline == pytest.approx(notice.at + preemption.grace_seconds())
    else:
        assert notice.deadline == pytest.approx(STOP_AT, abs=1)
    if provider == "aws":  # IMDSv2: a token first, then the document with it
        assert [r[:2] for r in cloud.requests[:2]] == [("PUT", "/latest/api/token"),
                                                        ("GET", "/latest/meta-data/spot/instance-action")]


def test_the_poller_thread_notices_within_its_interval_and_survives_an_unreachable_service(cloud, fresh, caplog):
    dead = preemption.NoticePoller("gcp", url="http://127.0.0.1:9", interval=0.05, timeout=0.5).start()
    poller = preemption.NoticePoller("aws", url=cloud.url, interval=0.05).start()
    try:
        with caplog.at_level(logging.DEBUG, logger="taskpoint"):
            assert wait_until(lambda: any("could not poll the gcp preemption notice" in r.getMessage()
                                          for r in caplog.records))  # the dead service's first poll failed
            assert preemption.notice() is None
            cloud.noticed = True
            assert wait_until(lambda: preemption.notice() is not None)
        assert dead._thread is not None and dead._thread.is_alive()  # kept trying
    finally:
        dead.stop()
        poller.stop()


def test_wrong_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown cloud"):
        preemption.NoticePoller("oracle")
    with pytest.raises(ValueError, match="interval"):
        preemption.NoticePoller("aws", interval=0)


@pytest.mark.e2e("starts a python process")
def test_a_manager_loop_saves_its_emergency_step_when_the_cloud_announces_a_stop(cloud, tmp_path: Path):
    """``TASKPOINT_SPOT_NOTICE=aws``: a manager created in the main thread polls the notice; the loop's next save
    is the emergency save, which commits and ends the process as a SIGTERM would."""
    script = ("import os, time, taskpoint\n"
              "state = {'n': 0}\n"
              "m = taskpoint.CheckpointManager(os.environ['DIR'], on_preemption=lambda: b'%d' % state['n'])\n"
              "print('ready', flush=True)\n"
              "for step in range(1, 100000):\n"
              "    state['n'] = step\n"
              "    time.sleep(0.002)\n"
              "    if step % 50 == 0:\n"
              "        m.save(b'%d' % step, step)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "DIR": str(tmp_path / "m"),
           "TASKPOINT_SPOT_NOTICE": "aws", "TASKPOINT_SPOT_NOTICE_URL": cloud.url,
           "TASKPOINT_SPOT_NOTICE_INTERVAL": "0.05"}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    time.sleep(0.3)
    cloud.noticed = True
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), err.decode()
    with taskpoint.CheckpointManager(tmp_path / "m", preemption=False) as mgr:
        step = mgr.latest_step()
        assert step is not None
        meta = mgr.metadata(step)["preempted"]
        assert meta["signal"] == "SIGTERM" and meta["deadline"] == pytest.approx(STOP_AT, abs=1)
        assert int(mgr.restore(step).read_bytes()) >= 50
