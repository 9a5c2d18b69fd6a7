"""Progress on the TrainJob status (KEP-2779): rank 0 POSTs to a real local HTTPS server.

The server stands in for Kubeflow Trainer's status server (kubeflow/trainer `pkg/statusserver`): TLS with
a certificate the worker trusts through the CA file, `POST .../trainjobs/<name>/status`, a bearer token,
a `metav1.Status` JSON answer on errors (422 on validation errors).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import re
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.crds import crd_schema
from training.config import load_worker_spec
from training.contract import Env, WorkerIdentity
from training.contract.events import Finished
from training.metrics import create_sinks
from training.metrics.base import RestoreRecord, StepRecord
from training.metrics.trainer_status import TrainerStatusEndpoint, TrainerStatusSink, format_value

PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs/demo/status"
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
WAIT_S = 10.0  # upper bound for waiting on the background thread (never reached when things work)


def step(i: int, *, t: float | None = None, loss: float = 0.5, world_size: int = 2) -> StepRecord:
    return StepRecord(step=i, loss=loss, samples=8, tokens=0, step_s=0.1, data_wait_s=0.0, comm_s=0.0,
                      world_size=world_size, lr=0.01, time=float(i) if t is None else t)  # fmt: skip


# -- the server ---------------------------------------------------------------------------------------
@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Behaviour:
    code: int = 200
    answer: dict[str, Any] = field(default_factory=dict)
    hold: threading.Event | None = None  # set: the first request waits for it (at most hold_s) for its answer
    hold_s: float = 10.0
    entered: threading.Event = field(default_factory=threading.Event)  # a request arrived
    answered: threading.Event = field(default_factory=threading.Event)  # an answer went out


class StatusServer:
    """A TLS HTTP server on 127.0.0.1 that records every request and answers as `behaviour` says."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.received: list[Received] = []
        self.behaviour = Behaviour()
        self.arrived = threading.Semaphore(0)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                outer.received.append(Received("POST", self.path, dict(self.headers.items()), json.loads(raw)))
                b = outer.behaviour
                b.entered.set()
                outer.arrived.release()
                if b.hold is not None and len(outer.received) == 1:
                    b.hold.wait(b.hold_s)
                data = json.dumps(b.answer or {"ok": True}).encode()
                self.send_response(b.code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                b.answered.set()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}{PATH}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def wait_for(self, n: int) -> None:
        """Wait until `n` more requests have arrived."""
        for _ in range(n):
            assert self.arrived.acquire(timeout=WAIT_S), f"no request within {WAIT_S} s ({len(self.received)} so far)"

    def stop(self) -> None:
        if self.behaviour.hold is not None:
            self.behaviour.hold.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA) and its key."""
    d = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainer-status-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = d / "ca.crt", d / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture
def server(tls: tuple[Path, Path]) -> Iterator[StatusServer]:
    s = StatusServer(*tls)
    yield s
    s.stop()


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("token-1\n")
    return path


def sink_for(url: str, tls: tuple[Path, Path], token: Path, **kwargs: Any) -> TrainerStatusSink:
    kwargs.setdefault("total_steps", 100)
    kwargs.setdefault("log_every", 1)
    kwargs.setdefault("min_interval_s", 0.0)
    return TrainerStatusSink(TrainerStatusEndpoint(url, str(tls[0]), str(token)), **kwargs)


def metrics_of(body: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["value"] for m in body["trainerStatus"]["metrics"]}


def check_against_crd(body: dict[str, Any]) -> None:
    """The body is what the status server accepts and the TrainJob CRD validates."""
    assert set(body) == {"trainerStatus"}
    status = body["trainerStatus"]
    schema = crd_schema("trainer.kubeflow.org/v1alpha1", "TrainJob")["properties"]["status"]["properties"]
    jsonschema.Draft7Validator(schema["trainerStatus"]).validate(status)  # types, ranges, lengths, maxItems
    assert RFC3339.match(status["lastUpdatedTime"]), status  # CEL: has(self.lastUpdatedTime); date-time
    datetime.datetime.fromisoformat(status["lastUpdatedTime"].replace("Z", "+00:00"))
    assert all(isinstance(m["value"], str) and 1 <= len(m["value"]) <= 64 for m in status["metrics"])


# -- the tests ----------------------------------------------------------------------------------------
def test_posts_the_status_with_a_fresh_token_and_the_shape_the_crd_accepts(
    server: StatusServer, tls: tuple[Path, Path], token: Path
) -> None:
    sink = sink_for(server.url, tls, token)
    sink.on_step(step(1))
    server.wait_for(1)
    token.write_text("token-2\n")  # the kubelet rotated the projected token
    sink.on_step(step(2))
    server.wait_for(1)
    sink.on_eval(2, {"loss": 0.25, "accuracy": 0.9694, "count": 360.0})
    sink.emit(Finished(step=2, final_loss=0.125, wall_s=3.0))
    sink.close()

    first, second, last = server.received
    assert [r.method for r in server.received] == ["POST"] * 3
    assert {r.path for r in server.received} == {PATH}
    assert first.headers["Authorization"] == "Bearer token-1"
    assert second.headers["Authorization"] == "Bearer token-2"
    assert first.headers["Content-Type"] == "application/json"
    for r in server.received:
        check_against_crd(r.body)
    assert first.body["trainerStatus"]["progressPercentage"] == 1
    assert "estimatedRemainingSeconds" not in first.body["trainerStatus"]  # one step: the rate is unknown
    assert second.body["trainerStatus"]["estimatedRemainingSeconds"] == 98  # 1 s per step, 98 to go
    assert metrics_of(second.body) == {"loss": "0.5", "lr": "0.01", "samples_per_s": "160", "step": "2",
                                       "total_steps": "100", "world_size": "2"}  # fmt: skip
    final = last.body["trainerStatus"]
    assert final["estimatedRemainingSeconds"] == 0
    assert metrics_of(last.body) == {"loss": "0.125", "lr": "0.01", "samples_per_s": "160", "step": "2",
                                     "total_steps": "100", "world_size": "2", "eval_loss": "0.25",
                                     "eval_accuracy": "0.9694", "eval_count": "360"}  # fmt: skip
    assert sink.poster.sent == 3 and sink.poster.failed == 0


def test_reports_every_log_every_steps_at_most_once_per_interval_and_always_at_the_end(
    server: StatusServer, tls: tuple[Path, Path], token: Path
) -> None:
    now = [0.0]
    sink = sink_for(server.url, tls, token, log_every=5, min_interval_s=10.0, clock=lambda: now[0])
    for i in range(1, 51):
        now[0] = i * 0.5  # 0.5 s per step: a log step every 2.5 s, a report every 10 s at most
        sink.on_step(step(i))
        if i in (5, 25, 45):
            server.wait_for(1)
    sink.on_step(step(51))
    sink.close()  # steps 46..51 are unsent: the final report carries them
    assert [metrics_of(r.body)["step"] for r in server.received] == ["5", "25", "45", "51"]
    assert server.received[-1].body["trainerStatus"]["progressPercentage"] == 51


def test_a_hanging_server_never_blocks_a_step_and_the_newest_status_wins(
    server: StatusServer, tls: tuple[Path, Path], token: Path
) -> None:
    server.behaviour.hold = threading.Event()  # the server takes 10 s to answer
    sink = sink_for(server.url, tls, token, timeout_s=30.0)  # a blocking call would wait for the server
    sink.on_step(step(1))
    assert server.behaviour.entered.wait(WAIT_S)
    for i in range(2, 52):
        sink.on_step(step(i))  # each one is due (min_interval 0): 50 reports queued behind the first
    assert not server.behaviour.answered.is_set()  # the loop finished while the server still held step 1
    server.behaviour.hold.set()
    server.wait_for(1)
    sink.close()
    # One slot: the 50 reports made while step 1 was in flight collapsed into the newest one.
    assert [metrics_of(r.body)["step"] for r in server.received] == ["1", "51"]


def test_close_gives_up_on_a_hanging_server_within_its_timeout(
    server: StatusServer, tls: tuple[Path, Path], token: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server.behaviour.hold = threading.Event()
    sink = sink_for(server.url, tls, token, timeout_s=30.0, close_timeout_s=0.2)
    sink.on_step(step(1))
    assert server.behaviour.entered.wait(WAIT_S)
    with caplog.at_level(logging.WARNING, logger="training.metrics.trainer_status"):
        sink.close()
    assert not server.behaviour.answered.is_set()  # close returned while the server still held the request
    assert "was not sent within" in caplog.text


def test_a_refused_status_is_logged_once_with_the_servers_message(
    server: StatusServer, tls: tuple[Path, Path], token: Path, caplog: pytest.LogCaptureFixture
) -> None:
    message = 'TrainJob.trainer.kubeflow.org "demo" is invalid: status.trainerStatus.progressPercentage: Invalid'
    server.behaviour.code = 422
    server.behaviour.answer = {"metadata": {}, "status": "Failure", "message": message, "reason": "Invalid",
                               "code": 422}  # fmt: skip
    sink = sink_for(server.url, tls, token)
    with caplog.at_level(logging.WARNING, logger="training.metrics.trainer_status"):
        for i in range(1, 4):
            sink.on_step(step(i))
            server.wait_for(1)
        sink.close()
    assert len(server.received) == 3 and sink.poster.failed == 3 and sink.poster.sent == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text  # rate-limited
    assert "HTTP 422" in warnings[0].getMessage() and message in warnings[0].getMessage()


def test_a_dead_server_or_a_wrong_ca_costs_training_nothing(
    tls: tuple[Path, Path], token: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    dead = sink_for(f"https://127.0.0.1:{port}{PATH}", tls, token)
    with caplog.at_level(logging.WARNING, logger="training.metrics.trainer_status"):
        for i in range(1, 51):
            dead.on_step(step(i))
        dead.close()
    assert dead.poster.sent == 0 and dead.poster.failed >= 1
    assert "cannot report the TrainJob status" in caplog.text
    endpoint = TrainerStatusEndpoint(f"https://127.0.0.1:{port}{PATH}", str(tmp_path / "no-ca"), str(tmp_path / "no"))
    missing = TrainerStatusSink(endpoint, total_steps=10, log_every=1, min_interval_s=0.0)
    missing.on_step(step(1))
    missing.close()
    assert missing.poster.failed == 1


def test_remaining_time_follows_the_recent_rate_and_restarts_after_a_restore(
    tls: tuple[Path, Path], token: Path
) -> None:
    sink = sink_for("https://127.0.0.1:9/never", tls, token, log_every=1000)  # nothing is due: no request
    for i in range(1, 11):
        sink.on_step(step(i, t=100.0 + 2.0 * i))  # 2 s per step
    assert sink.status()["trainerStatus"]["estimatedRemainingSeconds"] == 180
    sink.on_restore(RestoreRecord(step=8, store="file", seconds=1.0))
    sink.on_step(step(9, t=500.0))
    assert "estimatedRemainingSeconds" not in sink.status()["trainerStatus"]
    sink.on_step(step(10, t=500.5))
    status = sink.status()["trainerStatus"]
    assert status["estimatedRemainingSeconds"] == 45 and status["progressPercentage"] == 10
    sink.poster.close(1.0)


def test_metric_values_are_short_strings() -> None:
    assert format_value(360.0) == "360"
    assert format_value(7) == "7"
    assert format_value(0.016123456789) == "0.0161235"
    assert format_value(float("nan")) == "nan" and format_value(float("-inf")) == "-inf"
    assert format_value(1e300) == "1e+300"
    assert len(format_value(10**80)) == 64


SPEC = """
metadata: {name: demo}
spec:
  task: {entrypoint: "training.examples.digits:task"}
  training: {steps: 10}
  metrics: {enabled: false, logEvery: 2}
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_create_sinks_reports_from_rank_0_only_when_the_trainer_gave_an_endpoint(rank: int) -> None:
    spec = load_worker_spec(SPEC)
    identity = WorkerIdentity(job="demo", rank=rank, world_size=2, local_rank=rank, local_world_size=2)
    env = {Env.TRAINER_STATUS_URL: "https://127.0.0.1:9" + PATH, Env.TRAINER_STATUS_CA_CERT: "/x/ca.crt",
           Env.TRAINER_STATUS_TOKEN: "/x/token"}  # fmt: skip
    with_env = create_sinks(spec, identity, env)
    without = create_sinks(spec, identity, {})
    found = [s for s in with_env.sinks if isinstance(s, TrainerStatusSink)]
    assert len(found) == (1 if rank == 0 else 0)
    assert not any(isinstance(s, TrainerStatusSink) for s in without.sinks)
    if found:
        assert found[0].poster.endpoint == TrainerStatusEndpoint("https://127.0.0.1:9" + PATH, "/x/ca.crt", "/x/token")
        assert found[0].total_steps == 10 and found[0].log_every == 2
    with_env.close()
    without.close()
