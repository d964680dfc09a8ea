"""What to do when vLLM fails: roll a new revision back, retry a proven one with backoff, or halt a crash loop."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from engine.db import RevisionStatus
from engine.vllm import Diagnosis, diagnose

Action = Literal["rollback", "retry", "halt"]


@dataclass(frozen=True)
class Decision:
    action: Action
    diagnosis: Diagnosis
    delay_s: float
    message: str


class RecoveryPolicy:
    def __init__(self, backoff_initial_s: float, backoff_max_s: float, max_failures: int, window_s: float) -> None:
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.max_failures = max_failures
        self.window_s = window_s
        self.failures: deque[float] = deque()
        self.attempt = 0

    def decide(self, revision_id: int | None, status: str | None, was_ready: bool, lines: Sequence[str],
               now: float | None = None) -> Decision:
        """A revision that never became ready is rejected and the last good one returns; a revision that ran
        before is retried with capped exponential backoff, until ``max_failures`` within ``window_s``."""
        now = time.monotonic() if now is None else now
        diagnosis = diagnose(lines, running=was_ready)
        if status == RevisionStatus.PENDING.value and not was_ready:
            return Decision("rollback", diagnosis, 0.0,
                            f"revision {revision_id} never became ready ({diagnosis.kind}): rejected; the last "
                            "revision that was ready is started again")
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.window_s:
            self.failures.popleft()
        if len(self.failures) >= self.max_failures:
            return Decision("halt", diagnosis, 0.0,
                            f"{len(self.failures)} failures within {self.window_s:.0f} s ({diagnosis.kind}): restarts "
                            "halted; fix the cause, then start the engine again")
        self.attempt += 1
        delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (self.attempt - 1))
        return Decision("retry", diagnosis, delay,
                        f"revision {revision_id} failed ({diagnosis.kind}); retrying in {delay:.0f} s "
                        f"(attempt {self.attempt})")

    def ready(self) -> None:
        self.attempt = 0

    def reset(self) -> None:
        self.failures.clear()
        self.attempt = 0
