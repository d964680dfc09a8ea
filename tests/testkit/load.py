"""A test load: N client threads sending streaming and non-streaming requests in a loop until told to stop.

Each request's outcome is recorded: HTTP status, whether a stream ended with [DONE], an error event or an
exception, and how long it took. The client timeout is long (requests may wait in the gateway's queue while vLLM
restarts) but finite, so a hanging request shows up as an exception, not as a stuck test.

Every request has its own text (a random token first), so none is served from vLLM's prefix cache: an apply's
new instance is measured on prompts it has never seen, as after a real apply.
"""

from __future__ import annotations

import itertools
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# Longer than any stretch without a completed request that an apply beside the serving instance causes on a busy
# 2-core machine (2.6 s the worst seen), shorter than a pause (a whole vLLM start, 30 s or more): the system tier
# tells the two apart; `python -m bench apply-gap` measures the figure itself.
PAUSE_BOUND_S = 15.0


@dataclass
class Outcome:
    client: int
    stream: bool
    status: int | None
    seconds: float
    done: bool = False  # stream ended with [DONE]
    stream_error: str | None = None  # stream ended with an error event
    exception: str | None = None
    text: str = ""
    finished: float = 0.0  # time.monotonic() when it ended

    @property
    def ok(self) -> bool:
        return self.status == 200 and (self.done or not self.stream) and not self.stream_error and not self.exception


RUNNING: list[Load] = []  # loads started and not stopped: a test that failed midway leaves its clients here


def stop_leftovers() -> int:
    """Stop the clients a failed test left sending (they would keep the session's engine busy for every later
    test: never idle, never scaled to zero); how many loads were left."""
    left = list(RUNNING)
    for load in left:
        load._stop.set()
    for load in left:
        for t in load._threads:
            t.join(60)
    RUNNING[:] = [other for other in RUNNING if all(other is not load for load in left)]
    return len(left)


@dataclass
class Load:
    url: str
    clients: int = 16
    max_tokens: int = 8
    timeout_s: float = 420.0
    stream: bool | None = None  # None: every other request streams
    model: str = "demo"
    # Each client's wait between two requests. 0: back to back, every core busy serving (what an apply's gap is
    # measured under). A journey that only needs traffic flowing through a start leaves the cores room to start the
    # new instance beside the one that serves: on two cores, back-to-back clients stretch a start to minutes.
    pause_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        RUNNING.append(self)
        for i in range(self.clients):
            t = threading.Thread(target=self._run, args=(i,), daemon=True, name=f"load-{i}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self, join_timeout: float = 480.0) -> list[Outcome]:
        self._stop.set()
        RUNNING[:] = [other for other in RUNNING if other is not self]
        deadline = time.monotonic() + join_timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a client thread is still waiting: a request hangs"
        return self.outcomes

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def wait_for(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.count() < n:
            assert time.monotonic() < deadline, f"only {self.count()} of {n} requests finished"
            time.sleep(0.1)

    def _run(self, client: int) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as http:
            n = 0
            while not self._stop.is_set():
                stream = (n + client) % 2 == 0 if self.stream is None else self.stream
                n += 1
                try:
                    outcome = self._one(http, client, stream)
                except Exception as exc:  # noqa: BLE001 - a broken client is an outcome the test must see
                    outcome = Outcome(client, stream, None, 0.0, exception=f"client crashed: {exc!r}")
                with self._lock:
                    self.outcomes.append(outcome)
                if self.pause_s:
                    self._stop.wait(self.pause_s)

    def _one(self, http: httpx.Client, client: int, stream: bool) -> Outcome:
        text = f"{prompt_token()} client {client}: describe a module"
        body = {"model": self.model, "messages": [{"role": "user", "content": text}],
                "max_tokens": self.max_tokens, "temperature": 0.7, "stream": stream}
        t0 = time.monotonic()
        out = Outcome(client, stream, None, 0.0)
        try:
            if not stream:
                resp = http.post("/v1/chat/completions", json=body)
                out.status = resp.status_code
                out.text = resp.text[:300]
            else:
                with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    out.status = resp.status_code
                    for line in resp.iter_lines():
                        if line == "data: [DONE]":
                            out.done = True
                        elif line.startswith("data: "):
                            event = json.loads(line[6:])
                            if "error" in event:  # the gateway's (or vLLM's) error event ends a broken stream
                                out.stream_error = str(event["error"].get("message", event["error"]))
                        elif resp.status_code != 200:
                            out.text += line
        except httpx.HTTPError as exc:
            out.exception = f"{type(exc).__name__}: {exc}"
        out.finished = time.monotonic()
        out.seconds = out.finished - t0
        return out


def prompt_token() -> str:
    """A random word that starts a request's text (8 hex digits: a few microseconds, no shared prefix)."""
    return secrets.token_hex(4)


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    return {
        "total": len(outcomes),
        "ok": sum(1 for o in outcomes if o.status == 200 and (o.done or not o.stream) and not o.stream_error),
        "503": sum(1 for o in outcomes if o.status == 503),
        "stream_errors": sum(1 for o in outcomes if o.stream_error),
        "exceptions": sum(1 for o in outcomes if o.exception),
        "other": sum(1 for o in outcomes if o.status not in (200, 503, None)),
    }


def longest_gap_span(outcomes: list[Outcome], start: float, end: float) -> tuple[float, float]:
    """Where the longest stretch within [start, end] (monotonic) with no request completed successfully lies."""
    times = sorted(o.finished for o in outcomes if o.ok and start <= o.finished <= end)
    edges = [start, *times, end]
    return max(itertools.pairwise(edges), key=lambda pair: pair[1] - pair[0])


def longest_gap(outcomes: list[Outcome], start: float, end: float) -> float:
    """The longest stretch within [start, end] (monotonic) in which no request completed successfully."""
    a, b = longest_gap_span(outcomes, start, end)
    return b - a


def tokens_per_s(outcomes: list[Outcome], start: float, end: float, max_tokens: int) -> float:
    """Output tokens of the requests completed in [start, end], per second (each asks for ``max_tokens``)."""
    done = [o for o in outcomes if o.ok and start <= o.finished <= end]
    return round(len(done) * max_tokens / (end - start), 2) if end > start else 0.0


def parse_values(items: list[str]) -> dict[str, Any]:
    """Benchmarks' KEY=VALUE arguments: each value as JSON where it parses (4, 0.5, true), else as text."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out
