"""Wiring of the engine process: store, supervisor, telemetry, gateway, access control and the API in one app."""

from __future__ import annotations

import ipaddress
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pynvml
import uvicorn
from fastapi import Depends, FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from engine.access import AuditLog, AuditMiddleware, Auth
from engine.api.routes import access as api_access
from engine.api.routes import benchmarks as api_benchmarks
from engine.api.routes import gpu as api_telemetry
from engine.api.routes import prompts as api_prompts
from engine.api.routes import serving as api_serving
from engine.api.routes.core import build_router, install_error_handlers
from engine.benchmarks import Benchmarks
from engine.capacity import CalibrationStore, Planner
from engine.config import AppConfig
from engine.db import Store
from engine.errors import EngineError
from engine.gateway import Admission, Gateway, Ledger
from engine.gpu import AlertEngine, AlertThresholds, Sampler, TelemetryStore
from engine.metrics import HISTORY_METRICS, EngineCollector, RequestMetrics, SeriesStore, ServingMonitor, render
from engine.revisions import EngineSettings, initial_settings
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
    config.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.db_path)
    if store.ensure_initial(EngineSettings.model_construct(**initial_settings(config.data_dir.resolve())).model_dump()):
        store.add_event("settings_changed", "revision 1: initial settings (the demo model)", revision_id=1)
    auth = Auth(store, config.session_ttl_s, config.login_max_failures, config.login_lockout_s)
    audit = AuditLog(store)
    loopback = is_loopback(config.host)
    gateway_keys = config.gateway_keys == "on" or (config.gateway_keys == "auto" and not loopback)
    if not loopback and (config.gateway_keys == "off" or not (auth.has_users() or config.admin_password)):
        raise UnsafeConfigError(
            f"refusing to listen on {config.host} without authentication: set LLMOPS_ADMIN_PASSWORD (or create "
            "users first) and leave gateway_keys on; or listen on 127.0.0.1")
    generated = auth.ensure_admin(config.admin_password.get_secret_value() if config.admin_password else None)
    access = api_access.Access(auth, gateway_keys)

    admission = Admission(config.queue_size, config.queue_timeout_s)
    supervisor = Supervisor(config, store, admission, audit=audit)
    registry = CollectorRegistry()
    ledger = Ledger(store.engine, config.ledger_sample_rate, metrics=RequestMetrics(registry))
    gateway = Gateway(admission, config.upstream_timeout_s, supervisor.served_model, ledger)

    def emit(kind: str, message: str, severity: str, data: dict[str, Any]) -> None:
        gpu = data.get("gpu")
        store.add_event(kind, message, severity=severity, data=data,
                        revision_id=supervisor.running.id if supervisor.running and gpu is not None else None)

    history = TelemetryStore(store.engine, config.telemetry_raw_retention_s, config.telemetry_minute_retention_s)
    alerts = AlertEngine(AlertThresholds(memory_pct=config.alert_memory_pct,
                                         memory_clear_pct=config.alert_memory_pct - 5,
                                         temperature_c=config.alert_temperature_c,
                                         temperature_clear_c=config.alert_temperature_c - 5,
                                         power_hold_s=config.alert_power_hold_s, quiet_s=config.alert_quiet_s),
                         emit)
    sampler = Sampler(pynvml, config.gpu_sample_interval_s, supervisor.vllm_pids,
                      [history.write, alerts.evaluate], emit)
    planner = Planner(supervisor.build, config.data_dir.resolve(), sampler, CalibrationStore(store),
                      traffic_max_tokens=lambda: ledger.longest_request(86400))
    supervisor.planner = planner
    serving_history = SeriesStore(store.engine, "serving", "revision", HISTORY_METRICS,
                                  config.telemetry_raw_retention_s, config.telemetry_minute_retention_s)
    serving = ServingMonitor(config.serving_scrape_interval_s, lambda: admission.upstream,
                             lambda: admission.revision, serving_history)
    local = "127.0.0.1" if config.host in ("0.0.0.0", "::", "localhost") or loopback else config.host
    benchmarks = Benchmarks(store, supervisor, ledger, f"http://{local}:{config.port}", sampler.energy_now,
                            gateway_key=lambda: auth.create_token("benchmark", "prompter", "gateway", "engine",
                                                                  ttl_s=6 * 3600)[0] if gateway_keys else None,
                            revoke=lambda key: auth.revoke(token=key))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        store.add_event("engine_started", f"engine listening on {config.host}:{config.port}",
                        data={"data_dir": str(config.data_dir.resolve()), "vllm_build": supervisor.build,
                              "vllm_version": supervisor.vllm_version, "gateway_keys": gateway_keys})
        supervisor.start_background()
        sampler.start()
        serving.start()
        ledger.start()
        try:
            yield
        finally:
            await benchmarks.close()
            await serving.stop()
            await ledger.close()
            sampler.stop()
            await supervisor.shutdown()
            await gateway.aclose()
            store.add_event("engine_stopped", "engine stopped")
            store.close()

    app = FastAPI(title="llmops engine", version="0.1.0", lifespan=lifespan)
    app.state.config = config
    app.state.store = store
    app.state.supervisor = supervisor
    app.state.auth = auth
    app.state.generated_admin_password = generated
    install_error_handlers(app)
    app.add_middleware(AuditMiddleware, log=audit)
    guarded: dict[str, Any] = {"dependencies": [Depends(access.authorize)], "responses": api_access.RESPONSES}
    public_url = config.public_url or f"http://{local}:{config.port}"
    app.include_router(build_router(store, supervisor, planner, public_url, gateway_keys), **guarded)
    app.include_router(api_access.build_router(auth, audit), **guarded)
    app.include_router(api_serving.build_router(serving, serving_history, ledger), **guarded)
    app.include_router(api_benchmarks.build_router(benchmarks), **guarded)
    app.include_router(api_telemetry.build_router(sampler, history, alerts), **guarded)
    app.include_router(api_prompts.build_router(store), **guarded)
    app.include_router(gateway.router(), dependencies=[Depends(access.authorize_gateway)],
                       responses={401: api_access.RESPONSES[401], 429: {"description": "this key's rate limit"}})
    registry.register(EngineCollector(supervisor.status, lambda: sampler.latest, lambda: serving.latest,
                                      lambda: store.event_counts(["rollback", "failed", "crash_loop"])))

    @app.get("/metrics", tags=["export"], response_class=Response, **guarded)
    def metrics() -> Response:
        """The engine's own metrics in Prometheus format (docs/grafana-dashboard.json reads them)."""
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

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
