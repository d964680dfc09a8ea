"""The engine's event log: what it did and why, in order."""

from __future__ import annotations

from engine.events.log import EventLog

__all__ = ["EventLog"]
