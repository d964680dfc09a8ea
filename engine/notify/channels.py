"""Sending an alert to a webhook: a Slack-compatible body (``{"text": ...}``, which Slack, Mattermost, Rocket.Chat
and Discord's /slack endpoint take) or a generic JSON body, POSTed with a timeout, tried again with backoff, and
what it answered kept with the alert. A URL is http or https; its path and query (where a webhook keeps its secret)
are never shown by the API."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from engine.errors import EngineError

TIMEOUT_S = 5.0
TRIES = 3
BACKOFF_S = 1.0  # then 2, 4
MAX_URL = 2048


class ChannelError(EngineError):
    """A channel's URL or kind is not one that can be sent to."""


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if len(url) > MAX_URL or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ChannelError("url: an http:// or https:// address with a host, at most 2,048 characters")
    if any(ord(c) < 33 for c in url):
        raise ChannelError("url: no spaces or control characters")
    return url


def shown_url(url: str) -> str:
    """What the API shows of a URL: its scheme, host and port (its path and query may hold a secret)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}/…"


@dataclass(frozen=True)
class Alert:
    """One notice: an alert that fired or resolved (or a test)."""

    status: str  # firing | resolved | test
    rule: str
    kind: str
    title: str
    subject: str
    message: str
    value: float | None
    threshold: float | None
    fired_at: float
    resolved_at: float | None
    engine: str  # the engine's address (a link back)
    alert_id: int | None = None


def slack_body(a: Alert) -> dict[str, Any]:
    mark = {"firing": ":rotating_light: FIRING", "resolved": ":white_check_mark: RESOLVED",
            "test": ":bell: TEST"}[a.status]
    figure = f" (value {a.value:g}, threshold {a.threshold:g})" if a.value is not None and a.threshold is not None \
        else ""
    return {"text": f"{mark} · {a.title} · {a.subject}{figure}\n{a.message}\nrule {a.rule} · {a.engine}"}


def generic_body(a: Alert) -> dict[str, Any]:
    return {"status": a.status, "rule": a.rule, "kind": a.kind, "title": a.title, "subject": a.subject,
            "message": a.message, "value": a.value, "threshold": a.threshold, "fired_at": a.fired_at,
            "resolved_at": a.resolved_at, "engine": a.engine, "alert_id": a.alert_id}


async def send(client: httpx.AsyncClient, kind: str, url: str, alert: Alert, tries: int = TRIES,
               backoff_s: float = BACKOFF_S) -> dict[str, Any]:
    """POST the alert; what happened: ok, the last status or error, tries, when."""
    body = slack_body(alert) if kind == "slack" else generic_body(alert)
    detail = ""
    status: int | None = None
    for n in range(tries):
        try:
            resp = await client.post(url, json=body, timeout=TIMEOUT_S)
            status = resp.status_code
            if resp.is_success:
                return {"ok": True, "status": status, "tries": n + 1, "at": time.time()}
            detail = resp.text[:200]
            if 400 <= status < 500 and status != 429:  # refused for good: trying again changes nothing
                break
        except httpx.HTTPError as exc:
            detail = f"{type(exc).__name__}: {exc}"[:200]
        if n + 1 < tries:
            await asyncio.sleep(backoff_s * 2**n)
    return {"ok": False, "status": status, "detail": detail, "tries": n + 1, "at": time.time()}
