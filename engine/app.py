"""Wiring of the engine process: store, controller, telemetry, gateway, access control and the API in one app."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pynvml
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import col, select
from starlette.types import Receive, Scope, Send

from engine.access import (
    AuditLog,
    AuditMiddleware,
    AuditTallies,
    Auth,
    GatewayKeys,
    RateLimiter,
    Teams,
    ensure_console_key,
)
from engine.api import AccessGate, Services, mount
from engine.api.guard import BodyGuard, Limits
from engine.benchmarks import Benchmarks
from engine.bodies import BodyBudget, RequestBounds
from engine.capacity import TRAFFIC_WINDOW_S, CalibrationStore, Planner, TrafficNeed
from engine.config import AppConfig
from engine.db import (
    DEFAULT_DEPLOYMENT,
    INSTANCE_METRICS,
    INSTANCE_MINUTE,
    INSTANCE_RAW,
    SCALING_METRICS,
    SCALING_MINUTE,
    SCALING_RAW,
    SERVING_MINUTE,
    SERVING_RAW,
    ApiToken,
    Database,
    open_database,
)
from engine.deployments import DeploymentStore, Fleet, Runtime
from engine.edge import HostCheck, edge_protocol, engine_hosts, head_limits, host_of, refuse_host
from engine.errors import EngineError
from engine.events import EventLog
from engine.gateway import (
    PERIODS,
    BodyLimits,
    Coordinator,
    DataPath,
    Emit,
    Gateway,
    KeyLimits,
    Ledger,
    WorkerPool,
    WorkersCollector,
    WorkerSpec,
)
from engine.gpu import AlertEngine, AlertThresholds, Sampler, TelemetryStore
from engine.metrics import (
    HISTORY_METRICS,
    BudgetCollector,
    EngineCollector,
    LoopLag,
    RequestMetrics,
    SeriesStore,
    ServingMonitor,
)
from engine.notify import AlertStore, Notifier, Serving, Sources
from engine.placement import Placement
from engine.private import make_private
from engine.prompts import PromptStore
from engine.revisions import EngineSettings, RevisionStore, initial_settings
from engine.schemas import AutoscaleOut
from engine.vllm import (
    PrivateRotatingFileHandler,
    VllmFlags,
    redact_secrets,
    remove_ipc_folder,
    session_nice,
    vllm_distribution,
)


class UnsafeConfigError(EngineError):
    """The engine would be reachable from the network without authentication."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RedactSecrets(logging.Filter):
    """Access-log lines (when ``access_log`` is on) without keys or tokens sent in a query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_secrets(a) if isinstance(a, str) else a for a in record.args)
        return True


class EngineApp(FastAPI):
    """The engine's ASGI app: /v1 traffic goes straight to the gateway's raw data path, everything else through
    FastAPI and its middleware (audit, access gate, body guard)."""

    data_path: DataPath | None = None
    hosts: HostCheck | None = None  # the Host names it answers (DNS rebinding): /v1 included

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.hosts is not None and scope["type"] in ("http", "websocket") and \
                not self.hosts.admits(host := host_of(scope)):
            await refuse_host(scope, send, self.hosts.refusal(host or ""))
            return
        if self.data_path is not None and self.data_path.handles(scope):
            await self.data_path(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def raise_priority(nice: int) -> str | None:
    """Ask for the engine's CPU priority (engine_nice); what went wrong, if it was refused."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        return (f"engine_nice {nice} was refused (it needs root or CAP_SYS_NICE): the gateway runs at nice "
                f"{os.getpriority(os.PRIO_PROCESS, 0)}, and on a host whose cores vLLM keeps busy it will add latency")
    if os.getsid(0) == os.getpid():  # its own session (llmops up starts it so): the session's weight too
        return session_nice(os.getpid(), nice)
    return None


def free_space_problem(folder: Path, least: int) -> str | None:
    """Why a change cannot be recorded now (the disk under the data dir nearly full), or None."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        return f"the data dir {folder} cannot be read ({exc.strerror})"
    if free < least:
        return (f"the disk of the data dir {folder} has {free / 2**20:.0f} MiB free, less than min_free_disk_bytes "
                f"({least / 2**20:.0f} MiB): free some space and try again")
    return None


def scaling_row(view: AutoscaleOut | None) -> dict[str, float | None] | None:
    """A deployment's autoscaling status as a row of the scaling history (SCALING_METRICS)."""
    if view is None:
        return None
    return {"replicas_serving": float(view.serving), "replicas_wanted": float(view.wanted), "load": view.load}


def create_app(config: AppConfig, *, placement: Placement | None = None) -> FastAPI:
    """The composition root: every service built once, the lifespan that starts and stops them in order, the
    routes, the access gate and the audit. ``placement``: where vLLM instances run (default: as configured; the
    console's tests give a fake vLLM's)."""
    make_private(config.data_dir)
    db = open_database(config.database)
    logging.getLogger("llmops.engine").info("database: %s (%s)", db.where, db.dialect)  # never its password
    make_private(config.data_dir)  # the database's files now exist
    revisions, events, prompts = RevisionStore(db), EventLog(db), PromptStore(db)
    deployments = DeploymentStore(db)
    initial = EngineSettings.model_construct(**initial_settings(config.data_dir.resolve())).model_dump()
    first_rev = revisions.desired_revision() or (revisions.get_revision(head) if (head := revisions.head_revision_id())
                                                 else None)
    deployments.ensure_default(str((first_rev.values if first_rev else initial).get("served_model_name") or "demo"))
    if revisions.ensure_initial(initial):
        events.of(DEFAULT_DEPLOYMENT).add("settings_changed", "revision 1: initial settings (the demo model)",
                                          revision_id=revisions.head_revision_id())
    auth = Auth(db, config.session_ttl_s, config.login_max_failures, config.login_lockout_s,
                config.login_hash_workers, config.login_hash_queue, config.login_hash_per_source)
    audit = AuditLog(db)
    tallies = AuditTallies(db, config.audit_tally_keys_per_minute, config.audit_tally_max_rows)
    console_key = ensure_console_key(config.console_key_path)
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

    build, vllm_version = vllm_distribution()
    flags = VllmFlags(config.vllm_python, vllm_version, config.data_dir / "run" / "vllm-flags.json")
    registry = CollectorRegistry()
    key_limits = KeyLimits(db, config.limit_cache_s)
    ledger = Ledger(db, config.ledger_sample_rate, metrics=RequestMetrics(registry), team_of=key_limits.team_of)
    loop_lag = LoopLag(registry)
    fleet: Fleet | None = None

    def emit(kind: str, message: str, severity: str, data: dict[str, Any]) -> None:  # from the sampler's thread
        events.add(kind, message, severity=severity, data=data)

    telemetry = TelemetryStore(db, config.telemetry_raw_retention_s, config.telemetry_minute_retention_s)
    alerts = AlertEngine(AlertThresholds(memory_pct=config.alert_memory_pct,
                                         memory_clear_pct=config.alert_memory_pct - 5,
                                         temperature_c=config.alert_temperature_c,
                                         temperature_clear_c=config.alert_temperature_c - 5,
                                         power_hold_s=config.alert_power_hold_s, quiet_s=config.alert_quiet_s),
                         emit)
    sampler = Sampler(pynvml, config.gpu_sample_interval_s, lambda: fleet.vllm_pids() if fleet else {},
                      [telemetry.write, alerts.evaluate], emit)
    planner = Planner(build, config.data_dir.resolve(), sampler, CalibrationStore(db),
                      traffic_max_tokens=lambda: ledger.longest_request(86400),
                      traffic_need=lambda: TrafficNeed(*need) if (need := ledger.longest_need(TRAFFIC_WINDOW_S))
                      else None)
    planner.sleep_mode = build == "cuda" and config.sleep_mode
    serving_history = SeriesStore(db, SERVING_RAW, SERVING_MINUTE, "revision", HISTORY_METRICS,
                                  config.telemetry_raw_retention_s, config.telemetry_minute_retention_s)
    instance_history = SeriesStore(db, INSTANCE_RAW, INSTANCE_MINUTE, "instance", INSTANCE_METRICS,
                                   config.telemetry_raw_retention_s, config.telemetry_minute_retention_s)
    scaling_history = SeriesStore(db, SCALING_RAW, SCALING_MINUTE, "deployment", SCALING_METRICS,
                                  config.telemetry_raw_retention_s, config.telemetry_minute_retention_s)
    local = "127.0.0.1" if config.host in ("0.0.0.0", "::", "localhost") or loopback else config.host

    def extras(runtime: Runtime) -> None:
        """What each deployment has besides its controller: the scrape of its vLLM's figures, its benchmarks."""
        admission = runtime.admission
        runtime.serving = ServingMonitor(config.serving_scrape_interval_s, lambda: admission.upstream,
                                         lambda: admission.revision, serving_history,
                                         headers=lambda: admission.upstream_headers,
                                         instances=lambda: admission.upstreams, instance_history=instance_history,
                                         deployment_id=admission.deployment_id,
                                         scaling=lambda: scaling_row(runtime.controller.autoscale_view()),
                                         scaling_history=scaling_history)
        runtime.benchmarks = Benchmarks(
            db, runtime.revisions, runtime.events, runtime.controller, ledger, f"http://{local}:{config.port}",
            sampler.energy_now,
            gateway_key=lambda: auth.create_token("benchmark", "prompter", "gateway", "engine",
                                                  ttl_s=6 * 3600)[0] if gateway_keys else None,
            revoke=lambda key: auth.revoke(token=key))

    fleet = Fleet(config, db, deployments, revisions, events, planner, audit, flags, extras=extras,
                  placement=placement)
    fleet.node_sinks = [telemetry.write, alerts.evaluate]  # the other nodes' samples, labelled by node
    gateway = Gateway(fleet.admission_for, config.upstream_timeout_s, ledger, limits=key_limits)
    registry.register(EngineCollector(
        lambda: fleet.default.controller.status(),
        lambda: {"local": sampler.latest, **{node: snap for node, snap in fleet.node_snapshots.items()
                                             if node != getattr(fleet.placement, "own_node", None)}},
        lambda: fleet.default.serving.latest if fleet.default.serving else None,
        lambda: events.event_counts(["rollback", "failed", "crash_loop"]),
        lambda: [r.controller.status() for r in list(fleet.runtimes.values())]))
    limits = RateLimiter()
    keys = GatewayKeys(auth, limits, gateway_keys)
    coordinator = Coordinator(fleet.admission_for, keys, ledger, fleet.models, key_limits)
    workers = gateway_workers(config, coordinator, gateway_keys,
                              lambda kind, message, severity, data: events.add(kind, message, severity=severity,
                                                                               data=data))
    registry.register(BudgetCollector(lambda: [(subject.split(" ", 1)[0], subject.split(" ", 1)[1], used, limit)
                                               for subject, used, limit in budgets_now(db, key_limits)]))
    alert_store = AlertStore(db)
    notifier = Notifier(db, alert_store, Sources(
        serving=lambda window_s: serving_by_name(ledger, deployments, window_s),
        queue_waits=lambda: {r.name: r.admission.queue_wait(time.monotonic()) for r in list(fleet.runtimes.values())},
        budgets=lambda: budgets_now(db, key_limits),
        deployment_names=lambda: {d.id: d.name for d in deployments.all() if d.id is not None}),
        config.public_url or f"http://{local}:{config.port}", config.alert_interval_s)
    services = Services(config=config, db=db, events=events, prompts=prompts, auth=auth, audit=audit,
                        tallies=tallies, limits=limits, fleet=fleet, deployments=deployments, planner=planner,
                        sampler=sampler,
                        telemetry=telemetry, alerts=alerts, serving_history=serving_history,
                        instance_history=instance_history, scaling_history=scaling_history, ledger=ledger,
                        gateway=gateway, registry=registry,
                        public_url=config.public_url or f"http://{local}:{config.port}", gateway_keys=gateway_keys,
                        build=build, vllm_version=vllm_version, workers=workers,
                        data_url=data_url(config, local) if workers is not None else None, key_limits=key_limits,
                        alert_store=alert_store, notifier=notifier)
    if workers is not None:
        registry.register(WorkersCollector(workers))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await events.emit("engine_started", f"engine listening on {config.host}:{config.port}",
                          data={"data_dir": str(config.data_dir.resolve()), "database": db.where,
                                "vllm_build": build, "vllm_version": vllm_version, "gateway_keys": gateway_keys})
        if workers is not None:  # first: a data port that cannot be bound stops the start before vLLM's
            await workers.start()
        await asyncio.to_thread(sampler.start)  # its first sample (NVML) is there before anyone asks
        await fleet.start()
        ledger.start()
        tallies.start()
        loop_lag.start()
        notifier.start()
        # what the start made (modules, models, tables: most of the heap) is never garbage: the collector's full
        # passes leave it out, and stop stalling the event loop for 100 ms (seen at 500 requests/s on 2 cores)
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await loop_lag.close()
            await notifier.close()
            if workers is not None:  # their streams end first: the instances still serve them
                await workers.stop()
            await fleet.shutdown()  # before the sampler: waiting for the GPU's memory reads its samples
            await asyncio.to_thread(remove_ipc_folder, config.data_dir)  # vLLM's children are gone: their sockets too
            await asyncio.to_thread(sampler.stop)
            try:
                await ledger.close()
            except SQLAlchemyError as exc:  # a database down as the engine stops: the stop goes on, loudly
                logging.getLogger("llmops.engine").error("the request ledger's last records are lost: %s", exc)
            await gateway.aclose()
            if not await asyncio.to_thread(auth.flush_uses, 5.0):
                logging.getLogger("llmops.engine").warning("tokens' last uses were still being written after 5 s: "
                                                           "some may be lost")
            try:
                await events.emit("engine_stopped", "engine stopped")
            except SQLAlchemyError as exc:
                logging.getLogger("llmops.engine").error("could not record the engine's stop: %s", exc)
            try:
                await tallies.close()
            except SQLAlchemyError as exc:
                logging.getLogger("llmops.engine").error("the audit's last counts of refused requests are lost: %s",
                                                         exc)
            db.close()

    # No /docs or /redoc (their pages load from a CDN); the schema is a signed-in route (engine/api/routes/docs.py).
    app = EngineApp(title="llmops engine", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                    openapi_url=None)
    app.state.services = services
    app.state.generated_admin_password = generated
    app.hosts = engine_hosts(config)
    # /v1 bodies, data path and /v1/generate together, and each client's share of them
    budget = BodyBudget(config.v1_body_budget_bytes, config.v1_body_share)
    app.data_path = DataPath(gateway, keys, BodyLimits(config.body_limit_v1_bytes, config.body_timeout_s,
                                                       config.json_max_depth, config.v1_body_budget_bytes,
                                                       config.body_first_byte_s,
                                                       RequestBounds(config.v1_max_n, config.v1_max_prompts,
                                                                     config.v1_max_asked_tokens),
                                                       config.limit_bytes_per_token,
                                                       config.limit_unasked_max_tokens),
                             budget, models=fleet.models)
    mount(app)
    app.add_middleware(BodyGuard, limits=Limits(config.body_limit_auth_bytes, config.body_limit_api_bytes,
                                                config.body_limit_v1_bytes, config.json_max_depth,
                                                config.body_timeout_s, config.body_first_byte_s), budget=budget)
    app.add_middleware(AccessGate, api=app, auth=auth, keys=keys,  # roles before bodies: inside the audit
                       writable=lambda: free_space_problem(config.data_dir, config.min_free_disk_bytes))
    app.add_middleware(AuditMiddleware, log=audit, tallies=tallies, console_key=console_key)
    return app


def serving_by_name(ledger: Ledger, deployments: DeploymentStore, window_s: float) -> dict[str, Serving]:
    """Each deployment's serving figures over the window, by name (what alert rules watch)."""
    names = {d.id: d.name for d in deployments.all() if d.id is not None}
    return {names.get(dep, f"deployment {dep}"): Serving(*figures)
            for dep, figures in ledger.by_deployment(window_s).items()}


def budgets_now(db: Database, limits: KeyLimits) -> list[tuple[str, int, int]]:
    """(subject, used, limit) of every team's and active gateway key's token budget now."""
    out = []
    for team in Teams(db).all():
        if team.id is not None and team.token_budget and team.budget_period in PERIODS:
            used, _, _ = limits.budget_now("team", team.id, team.budget_period)
            out.append((f"team {team.name}", used, team.token_budget))
    with db.read() as s:
        keys = s.exec(select(ApiToken).where(col(ApiToken.token_budget).is_not(None),
                                             col(ApiToken.revoked_at).is_(None))).all()
    for key in keys:
        if key.id is not None and key.token_budget and key.budget_period in PERIODS:
            used, _, _ = limits.budget_now("key", key.id, key.budget_period)
            out.append((f"key {key.name}", used, key.token_budget))
    return out


def data_url(config: AppConfig, local: str) -> str:
    """The data port's address as clients reach it: the public URL's host (or the engine's), on data_port."""
    host = urlsplit(config.public_url).hostname if config.public_url else None
    host = host or local
    return f"http://{f'[{host}]' if ':' in host else host}:{config.data_port}"


def gateway_workers(config: AppConfig, coordinator: Coordinator, keys_required: bool, emit: Emit
                    ) -> WorkerPool | None:
    """The data path's worker processes (gateway_workers), or None when there are none."""
    count = config.gateway_worker_count
    if not count:
        return None
    hosts = engine_hosts(config)
    budget = max(config.body_limit_v1_bytes, config.v1_body_budget_bytes // count)  # the budget, shared out
    spec = WorkerSpec(index=0, engine_port=config.port, hosts=[*hosts.names, *hosts.suffixes, *(["*"] if hosts.any
                                                                                               else [])],
                      head_bytes=config.header_limit_bytes, line_bytes=config.header_line_limit_bytes,
                      head_timeout_s=config.header_timeout_s, body_max_bytes=config.body_limit_v1_bytes,
                      body_timeout_s=config.body_timeout_s, json_max_depth=config.json_max_depth,
                      body_budget_bytes=budget, body_share_bytes=min(budget, config.v1_body_share),
                      body_first_byte_s=config.body_first_byte_s, max_n=config.v1_max_n,
                      max_prompts=config.v1_max_prompts, max_asked_tokens=config.v1_max_asked_tokens,
                      upstream_timeout_s=config.upstream_timeout_s, ledger_sample_rate=config.ledger_sample_rate,
                      keys_required=keys_required, graceful_s=config.drain_timeout_s,
                      trusted_proxies=list(config.trusted_proxies),
                      limit_bytes_per_token=config.limit_bytes_per_token,
                      limit_unasked_max_tokens=config.limit_unasked_max_tokens)
    return WorkerPool(count, config.host, config.data_port, spec, coordinator, emit,
                      stop_timeout_s=config.drain_timeout_s + 5, busy_share=config.gateway_worker_busy_share)


def engine_log_handler(config: AppConfig) -> logging.Handler:
    """DATA_DIR/logs/engine.log: rotated like vLLM's log, 0600, and opened again (its folder too) when someone
    deletes or moves it (a plain FileHandler writes on into the deleted file, and the log is gone)."""
    return PrivateRotatingFileHandler(config.logs_dir / "engine.log", maxBytes=config.log_max_bytes,
                                      backupCount=config.log_backups)


def serve(config: AppConfig) -> None:
    """Run the engine in this process until SIGINT/SIGTERM."""
    os.umask(0o077)  # what the engine and vLLM write (database, logs, pid files) is the engine user's alone
    priority = raise_priority(config.engine_nice)  # before any thread: threads inherit it
    config.logs_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.StreamHandler(), engine_log_handler(config)])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per vLLM probe and scrape is noise
    logging.getLogger("uvicorn.access").addFilter(RedactSecrets())  # a key sent in a URL stays out of the log
    app = create_app(config)
    if priority:
        logging.getLogger("llmops.engine").warning(priority)
    if app.state.generated_admin_password:
        # Printed once to the terminal, never logged: the only copy of the first admin's password.
        print(f"\n  Created the console user 'admin' with password: {app.state.generated_admin_password}\n"
              "  (shown once; change it on the console's Access page)\n", file=sys.stderr, flush=True)
    uvicorn.Server(server_config(app, config)).run()


def server_config(app: FastAPI, config: AppConfig) -> uvicorn.Config:
    """How uvicorn serves the engine. Forwarded headers (X-Forwarded-For, -Proto) are believed only from
    ``trusted_proxies``: uvicorn's default believes them from any loopback peer, so any local user could write
    the audit's source address."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="info", access_log=config.access_log,
                          timeout_graceful_shutdown=int(config.drain_timeout_s) or None, loop="uvloop",
                          http=edge_protocol(head_limits(config)),
                          proxy_headers=bool(config.trusted_proxies),
                          forwarded_allow_ips=list(config.trusted_proxies) or [])
