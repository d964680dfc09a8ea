"""What serving has been asked to do, apart from the desired revision: run or stay stopped (and why requests are
refused meanwhile), a restart of what serves, a halt after a crash loop, and the earliest next attempt after a
failure. Written by operators' commands (from the API's threads: single assignments) and by failures' decisions;
read by the controller at each tick."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Intent:
    enabled: bool = True
    stop_reason: str | None = None  # why requests are refused while stopped (None: an operator stopped it)
    restart_requested: bool = False
    halted: str | None = None  # why restarts stopped (a crash loop), until an operator starts again
    next_attempt: float = 0.0  # monotonic: no start before this (a backoff)
