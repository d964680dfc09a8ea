"""Alerts that reach someone: rules on GPU health, serving and budgets (engine/notify/rules.py), sent to webhooks
(Slack-compatible, or a generic JSON body) once when they fire and once when they resolve, what fired kept; the
Alertmanager rules file for the Prometheus exporter is docs/alerting/llmops-rules.yml."""

from __future__ import annotations

from engine.notify.channels import Alert, ChannelError, check_url, generic_body, send, shown_url, slack_body
from engine.notify.notifier import Notifier, Serving, Sources
from engine.notify.rules import KINDS, WINDOW_S, Change, KindInfo, Tracker
from engine.notify.store import AlertStore, AlertStoreError

__all__ = [
    "KINDS",
    "WINDOW_S",
    "Alert",
    "AlertStore",
    "AlertStoreError",
    "Change",
    "ChannelError",
    "KindInfo",
    "Notifier",
    "Serving",
    "Sources",
    "Tracker",
    "check_url",
    "generic_body",
    "send",
    "shown_url",
    "slack_body",
]
