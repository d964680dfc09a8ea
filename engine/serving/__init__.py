"""Serving: one deployment's vLLM instances kept serving its desired revision by a controller that takes one step
a tick (engine/serving/controller.py); the plans an apply follows (strategies/), the instances' states, readiness
and health, failures and recovery, ETAs and forecasts, and the status snapshot."""

from __future__ import annotations

from engine.serving.controller import Controller
from engine.serving.eta import Company, Eta, EtaTable, PastStart, estimate, past_start, start_view
from engine.serving.instances import Instance, Instances, Verdict
from engine.serving.recovery import Decision, RecoveryPolicy
from engine.serving.residency import Residency, Room, Tenant
from engine.serving.state import InvalidTransitionError, StateMachine
from engine.serving.strategies import gateway_limit, soft_change

__all__ = [
    "Company",
    "Controller",
    "Decision",
    "Eta",
    "EtaTable",
    "Instance",
    "Instances",
    "InvalidTransitionError",
    "PastStart",
    "RecoveryPolicy",
    "Residency",
    "Room",
    "StateMachine",
    "Tenant",
    "Verdict",
    "estimate",
    "gateway_limit",
    "past_start",
    "soft_change",
    "start_view",
]
