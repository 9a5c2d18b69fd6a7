"""Rank 0's progress on the TrainJob's `status.trainerStatus` (Kubeflow Trainer, KEP-2779).

Kubeflow Trainer v2.2+ with the alpha `TrainJobStatus` feature gate runs a status server in its
controller and injects its address into every trainer container (`Env.TRAINER_STATUS_URL`, the CA
certificate `Env.TRAINER_STATUS_CA_CERT`, the projected token file `Env.TRAINER_STATUS_TOKEN`). The
worker POSTs `{"trainerStatus": {progressPercentage, estimatedRemainingSeconds, metrics, lastUpdatedTime}}`
as JSON with `Authorization: Bearer <token>`; the server applies it to the TrainJob (server-side apply,
so each report replaces the previous one whole) and answers 422 with a `metav1.Status` message when the
API server rejects it (kubeflow/trainer `pkg/statusserver/server.go`).

Reporting never blocks or breaks training: `on_step` only swaps the newest status into a one-slot
mailbox (the latest wins) that a daemon thread sends with a short timeout; failures are logged at most
once per `LOG_EVERY_S` and otherwise ignored.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from training.contract import Env, EventKind
from training.metrics.base import MetricsSink, RestoreRecord, StepRecord

__all__ = ["StatusPoster", "TrainerStatusEndpoint", "TrainerStatusSink", "format_value"]

log = logging.getLogger(__name__)

MAX_LEN = 64  # a metric's name and value (the CRD's maxLength)
MAX_METRICS = 256  # the CRD's maxItems
INT32_MAX = 2**31 - 1
LOG_EVERY_S = 300.0  # a failing endpoint is logged at most this often
RATE_WINDOW = 100  # steps the remaining-time estimate looks back over


@dataclass(frozen=True)
class TrainerStatusEndpoint:
    """Where and how to report: the status URL, the CA file and the token file (None: not given)."""

    url: str
    ca_cert: str | None = None
    token_file: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainerStatusEndpoint | None:
        """The endpoint the Trainer injected, or None outside a TrainJob with the gate on."""
        env = os.environ if env is None else env
        url = env.get(Env.TRAINER_STATUS_URL, "")
        if not url:
            return None
        return cls(url, env.get(Env.TRAINER_STATUS_CA_CERT) or None, env.get(Env.TRAINER_STATUS_TOKEN) or None)


def format_value(value: float | int) -> str:
    """A metric value as the CRD wants it: a non-empty string of at most 64 characters.

    Integers (and integral floats such as a sample count) print as integers, other floats with 6
    significant digits; NaN and infinities as `nan` / `inf` / `-inf`.
    """
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)[:MAX_LEN]
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.6g}"


class _Throttled:
    """Logs a message at most once per `every_s` and says how many were left out in between."""

    def __init__(self, every_s: float, clock: Callable[[], float]) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last: float | None = None
        self._dropped = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self._dropped += 1
            return
        suffix = f" ({self._dropped} similar failures not logged)" if self._dropped else ""
        log.warning(msg + suffix, *args)
        self._last, self._dropped = now, 0


class StatusPoster:
    """Sends status bodies from a daemon thread; `submit` never waits for the network.

    The thread holds one pending body at most: a body submitted while another one is waiting replaces
    it. The token file and the CA file are read for every request (the projected token rotates; the
    Trainer keeps the CA in step with its webhook certificate).
    """

    def __init__(self, endpoint: TrainerStatusEndpoint, *, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.sent = 0  # requests the server accepted (2xx)
        self.failed = 0  # requests refused or not answered
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: dict[str, Any] | None = None
        self._busy = False
        self._closing = False
        self._warn = _Throttled(LOG_EVERY_S, time.monotonic)
        self._thread = threading.Thread(target=self._run, name="torchrig-trainer-status", daemon=True)
        self._thread.start()

    def submit(self, body: dict[str, Any]) -> None:
        """Queue `body` for sending, replacing a body that has not been sent yet."""
        with self._wake:
            if self._closing:
                return
            self._pending = body
            self._wake.notify()

    def close(self, timeout_s: float) -> bool:
        """Send what is pending, then stop; waits at most `timeout_s`. True when everything was sent."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout_s)
        with self._lock:
            return not self._thread.is_alive() and self._pending is None and not self._busy

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closing:
                    self._wake.wait()
                body, self._pending = self._pending, None
                if body is None:  # closing, nothing left
                    return
                self._busy = True
            try:
                self._post(body)
            except Exception:  # never let the thread die on a bug: the next report tries again
                self.failed += 1
                log.debug("trainer status report failed", exc_info=True)
            finally:
                with self._lock:
                    self._busy = False

    def _post(self, body: dict[str, Any]) -> None:
        ep = self.endpoint
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if ep.token_file:
            try:
                with open(ep.token_file, encoding="utf-8") as f:
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            except OSError as e:
                self._warn("cannot read the TrainJob status token %s: %s", ep.token_file, e)
        request = urllib.request.Request(ep.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            # The status server is in-cluster (`<svc>.<ns>.svc`): never through an HTTP(S)_PROXY.
            handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
            if ep.url.startswith("https:"):
                handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ep.ca_cert)))
            with urllib.request.build_opener(*handlers).open(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as e:
            self.failed += 1
            with e:
                message = _server_message(e)
            self._warn("the Trainer refused the TrainJob status (HTTP %d): %s", e.code, message)
            return
        except (OSError, ValueError, http.client.HTTPException) as e:  # URLError, timeouts, TLS, a bad URL / CA
            self.failed += 1
            self._warn("cannot report the TrainJob status to %s: %s", ep.url, e)
            return
        if self.sent == 0:
            log.info("reporting progress to the TrainJob status (%s)", ep.url)
        self.sent += 1


def _server_message(error: urllib.error.HTTPError) -> str:
    """The `message` of the server's `metav1.Status` answer, else its first 200 characters."""
    try:
        text = error.read(4096).decode("utf-8", "replace")
    except OSError:
        return error.reason if isinstance(error.reason, str) else str(error.reason)
    try:
        message = json.loads(text).get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else text.strip()[:200] or str(error.reason)


class TrainerStatusSink(MetricsSink):
    """Rank 0's progress, remaining time and latest metrics, POSTed to the Trainer's status server.

    A report goes out every `log_every` steps but at most once per `min_interval_s`, and always at
    the end (the `finished` event, or `close` when training stopped early). `close` waits at most
    `close_timeout_s` (default: twice the request timeout, room for one request in flight and the
    final one).
    """

    def __init__(
        self,
        endpoint: TrainerStatusEndpoint,
        *,
        total_steps: int,
        log_every: int,
        min_interval_s: float = 10.0,
        timeout_s: float = 5.0,
        close_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_steps = max(1, total_steps)
        self.log_every = max(1, log_every)
        self.min_interval_s = min_interval_s
        self.close_timeout_s = 2 * timeout_s if close_timeout_s is None else close_timeout_s
        self.clock = clock
        self.poster = StatusPoster(endpoint, timeout_s=timeout_s)
        self._recent: deque[StepRecord] = deque(maxlen=RATE_WINDOW)
        self._eval: dict[str, float] = {}
        self._last_sent: float | None = None
        self._final_loss: float | None = None
        self._unsent = False  # steps (or eval results) since the last report
        self._finished = False

    def on_restore(self, record: RestoreRecord) -> None:
        self._recent.clear()  # the rate before a restore says nothing about the rate after it

    def on_step(self, record: StepRecord) -> None:
        if self._recent and record.step <= self._recent[-1].step:
            self._recent.clear()
        self._recent.append(record)
        self._unsent = True
        if record.step % self.log_every == 0 or record.step >= self.total_steps:
            now = self.clock()
            if self._last_sent is None or now - self._last_sent >= self.min_interval_s:
                self._report(now)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._eval = dict(metrics)
        self._unsent = True

    def on_event(self, event: EventKind | str, **fields: Any) -> None:
        if event == EventKind.FINISHED and not self._finished:
            loss = fields.get("final_loss")
            self._final_loss = float(loss) if isinstance(loss, (int, float)) else None
            self._finished = True
            self._report(self.clock())

    def close(self) -> None:
        if self._unsent:
            self._report(self.clock())
        if not self.poster.close(self.close_timeout_s):
            log.warning("the final TrainJob status was not sent within %.0f s", self.close_timeout_s)

    # -- the report --------------------------------------------------------------------------------
    def _report(self, now: float) -> None:
        self._last_sent = now
        self._unsent = False
        self.poster.submit(self.status())

    def status(self) -> dict[str, Any]:
        """The request body for the current state: `{"trainerStatus": {...}}`."""
        status: dict[str, Any] = {}
        last = self._recent[-1] if self._recent else None
        if last is not None:
            status["progressPercentage"] = max(0, min(100, last.step * 100 // self.total_steps))
            eta = 0 if self._finished else self._remaining_s()
            if eta is not None:
                status["estimatedRemainingSeconds"] = eta
        status["metrics"] = self._metrics(last)
        status["lastUpdatedTime"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"trainerStatus": status}

    def _remaining_s(self) -> int | None:
        """Seconds to the last step at the wall-clock step rate of the recent steps; None until known."""
        if len(self._recent) < 2:
            return None
        first, last = self._recent[0], self._recent[-1]
        steps, seconds = last.step - first.step, last.time - first.time
        if steps <= 0 or seconds <= 0:
            return None
        remaining = max(0, self.total_steps - last.step) * seconds / steps
        return min(INT32_MAX, round(remaining))

    def _metrics(self, last: StepRecord | None) -> list[dict[str, str]]:
        values: dict[str, float | int] = {}
        if last is not None:
            values["loss"] = self._final_loss if self._final_loss is not None else last.loss
            values["lr"] = last.lr
            step_s = sum(r.step_s for r in self._recent)
            if step_s > 0:
                values["samples_per_s"] = sum(r.samples for r in self._recent) * last.world_size / step_s
            values["step"] = last.step
            values["total_steps"] = self.total_steps
            values["world_size"] = last.world_size
        for key, value in self._eval.items():
            values[f"eval_{key}"] = value
        out = [{"name": name[:MAX_LEN], "value": format_value(v)} for name, v in values.items() if name]
        return out[:MAX_METRICS]
