"""Wiring of the engine process: store, supervisor, telemetry, gateway, access control and the API in one app."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pynvml
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from engine.access import AuditLog, AuditMiddleware, Auth, RateLimiter
from engine.api import AccessGate, Services, mount
from engine.benchmarks import Benchmarks
from engine.capacity import CalibrationStore, Planner
from engine.config import AppConfig
from engine.db import SERVING_MINUTE, SERVING_RAW, open_database
from engine.errors import EngineError
from engine.events import EventLog
from engine.gateway import Admission, Gateway, Ledger
from engine.gpu import AlertEngine, AlertThresholds, Sampler, TelemetryStore
from engine.metrics import HISTORY_METRICS, EngineCollector, RequestMetrics, SeriesStore, ServingMonitor
from engine.prompts import PromptStore
from engine.revisions import EngineSettings, RevisionStore, SettingsWriter, initial_settings
from engine.serving import Supervisor


class UnsafeConfigError(EngineError):
    """The engine would be reachable from the network without authentication."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(config: AppConfig) -> FastAPI:
    """The composition root: every service built once, the lifespan that starts and stops them in order, the
    routes, the access gate and the audit."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    db = open_database(config.db_path)
    revisions, events, prompts = RevisionStore(db), EventLog(db), PromptStore(db)
    if revisions.ensure_initial(EngineSettings.model_construct(**initial_settings(config.data_dir.resolve()))
                                .model_dump()):
        events.add("settings_changed", "revision 1: initial settings (the demo model)", revision_id=1)
    auth = Auth(db, config.session_ttl_s, config.login_max_failures, config.login_lockout_s)
    audit = AuditLog(db)
    loopback = is_loopback(config.host)
    gateway_keys = config.gateway_keys == "on" or (config.gateway_keys == "auto" and not loopback)
    if not loopback and (config.gateway_keys == "off" or not (auth.has_users() or config.admin_password)):
        raise UnsafeConfigError(
            f"refusing to listen on {config.host} without authentication: set LLMOPS_ADMIN_PASSWORD (or create "
            "users first) and leave gateway_keys on; or listen on 127.0.0.1")
    first = not auth.has_users()
    generated = auth.ensure_admin(config.admin_password.get_secret_value() if config.admin_password else None)
    if first:
        audit.record(actor="engine", action="users.create", target="user admin", after={"role": "admin"},
                     detail="the first console user, from LLMOPS_ADMIN_PASSWORD or generated")

    admission = Admission(config.queue_size, config.queue_timeout_s)
    supervisor = Supervisor(config, revisions, events, admission, audit=audit)
    registry = CollectorRegistry()
    ledger = Ledger(db, config.ledger_sample_rate, metrics=RequestMetrics(registry))
    gateway = Gateway(admission, config.upstream_timeout_s, ledger)

    def emit(kind: str, message: str, severity: str, data: dict[str, Any]) -> None:  # from the sampler's thread
        gpu = data.get("gpu")
        events.add(kind, message, severity=severity, data=data,
                   revision_id=supervisor.running.id if supervisor.running and gpu is not None else None)

    telemetry = TelemetryStore(db, config.telemetry_raw_retention_s, config.telemetry_minute_retention_s)
    alerts = AlertEngine(AlertThresholds(memory_pct=config.alert_memory_pct,
                                         memory_clear_pct=config.alert_memory_pct - 5,
                                         temperature_c=config.alert_temperature_c,
                                         temperature_clear_c=config.alert_temperature_c - 5,
                                         power_hold_s=config.alert_power_hold_s, quiet_s=config.alert_quiet_s),
                         emit)
    sampler = Sampler(pynvml, config.gpu_sample_interval_s, supervisor.vllm_pids,
                      [telemetry.write, alerts.evaluate], emit)
    planner = Planner(supervisor.build, config.data_dir.resolve(), sampler, CalibrationStore(db),
                      traffic_max_tokens=lambda: ledger.longest_request(86400))
    supervisor.planner = planner
    writer = SettingsWriter(revisions, events, planner, config.data_dir.resolve(), config.model_roots,
                            wake=supervisor.wake)
    serving_history = SeriesStore(db, SERVING_RAW, SERVING_MINUTE, "revision", HISTORY_METRICS,
                                  config.telemetry_raw_retention_s, config.telemetry_minute_retention_s)
    serving = ServingMonitor(config.serving_scrape_interval_s, lambda: admission.upstream,
                             lambda: admission.revision, serving_history)
    local = "127.0.0.1" if config.host in ("0.0.0.0", "::", "localhost") or loopback else config.host
    benchmarks = Benchmarks(db, revisions, events, supervisor, ledger, f"http://{local}:{config.port}",
                            sampler.energy_now,
                            gateway_key=lambda: auth.create_token("benchmark", "prompter", "gateway", "engine",
                                                                  ttl_s=6 * 3600)[0] if gateway_keys else None,
                            revoke=lambda key: auth.revoke(token=key))
    registry.register(EngineCollector(supervisor.status, lambda: sampler.latest, lambda: serving.latest,
                                      lambda: events.event_counts(["rollback", "failed", "crash_loop"])))
    services = Services(config=config, db=db, revisions=revisions, writer=writer, events=events, prompts=prompts,
                        auth=auth, audit=audit, limits=RateLimiter(), supervisor=supervisor, planner=planner,
                        sampler=sampler, telemetry=telemetry, alerts=alerts, serving=serving,
                        serving_history=serving_history, ledger=ledger, benchmarks=benchmarks, gateway=gateway,
                        registry=registry, public_url=config.public_url or f"http://{local}:{config.port}",
                        gateway_keys=gateway_keys)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await events.emit("engine_started", f"engine listening on {config.host}:{config.port}",
                          data={"data_dir": str(config.data_dir.resolve()), "vllm_build": supervisor.build,
                                "vllm_version": supervisor.vllm_version, "gateway_keys": gateway_keys})
        await asyncio.to_thread(sampler.start)  # its first sample (NVML) is there before anyone asks
        await supervisor.start()
        serving.start()
        ledger.start()
        try:
            yield
        finally:
            await benchmarks.close()
            await serving.stop()
            await supervisor.shutdown()  # before the sampler: waiting for the GPU's memory reads its samples
            await asyncio.to_thread(sampler.stop)
            await ledger.close()
            await gateway.aclose()
            await events.emit("engine_stopped", "engine stopped")
            db.close()

    app = FastAPI(title="llmops engine", version="0.1.0", lifespan=lifespan)
    app.state.services = services
    app.state.generated_admin_password = generated
    mount(app)
    app.add_middleware(AccessGate, api=app, auth=auth)  # roles before bodies: it runs inside the audit
    app.add_middleware(AuditMiddleware, log=audit)
    return app


def serve(config: AppConfig) -> None:
    """Run the engine in this process until SIGINT/SIGTERM."""
    config.logs_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.StreamHandler(), logging.FileHandler(config.logs_dir / "engine.log")],
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per vLLM probe and scrape is noise
    app = create_app(config)
    if app.state.generated_admin_password:
        # Printed once to the terminal, never logged: the only copy of the first admin's password.
        print(f"\n  Created the console user 'admin' with password: {app.state.generated_admin_password}\n"
              "  (shown once; change it on the console's Access page)\n", file=sys.stderr, flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info", access_log=config.access_log,
                timeout_graceful_shutdown=int(config.drain_timeout_s) or None)
