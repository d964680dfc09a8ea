"""The ``llmops`` command line: run the engine and the console, build the demo model, manage settings."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from console.client import ClientError, EngineClient
from engine.config import AppConfig
from engine.revisions import FIELD_NAMES, field_help
from engine.schemas import ApplyPlanOut, CapacityOut, RevisionOut, StatusOut


def _config(args: argparse.Namespace) -> AppConfig:
    overrides = {k: v for k, v in vars(args).items() if k in AppConfig.model_fields and v is not None}
    return AppConfig(**overrides)


def _client(args: argparse.Namespace) -> EngineClient:
    url = args.engine_url or (f"http://127.0.0.1:{args.port}" if getattr(args, "port", None) else None)
    token = getattr(args, "token", None) or os.environ.get("LLMOPS_TOKEN")
    if not token:
        path = _cli_token_path(AppConfig(**({"data_dir": args.data_dir} if getattr(args, "data_dir", None) else {})))
        token = path.read_text().strip() if path.exists() else None
    return EngineClient(url or AppConfig().engine_url, token=token)


def _cli_token_path(config: AppConfig) -> Path:
    """A local admin token for the CLI on the engine's machine (mode 0600), written by `llmops up`."""
    return config.data_dir / "run" / "cli.token"


def _operator() -> str:
    """Who runs the command on this machine (the audit's actor for what the CLI does on the database)."""
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "cli"


def ensure_cli_token(config: AppConfig) -> Path:
    from engine.access import AuditLog, Auth
    from engine.db import open_database

    path = _cli_token_path(config)
    if not path.exists():
        db = open_database(config.db_path)
        token, row = Auth(db).create_token("local-cli", "admin", created_by="llmops up")
        AuditLog(db).record(actor=_operator(), action="tokens.create", target=f"token {row.id} {row.name}",
                            after={"role": row.role, "kind": row.kind, "prefix": row.prefix}, source="llmops up")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    return path


def cmd_token(args: argparse.Namespace) -> int:
    """Tokens are managed on the engine's own database: this is how the first one is made."""
    from engine.access import AuditLog, Auth, AuthError
    from engine.db import open_database

    db = open_database(_config(args).db_path)
    auth, audit = Auth(db), AuditLog(db)
    if args.action == "create":
        token, row = auth.create_token(args.name, args.role, args.kind, created_by=_operator(),
                                       ttl_s=args.expires_days * 86400 if args.expires_days else None,
                                       rate_limit_per_min=args.rate_limit)
        audit.record(actor=_operator(), action="tokens.create", target=f"token {row.id} {row.name}",
                     after={"role": row.role, "kind": row.kind, "prefix": row.prefix}, source="llmops token")
        print(token)  # its only copy
        print(f"token {row.id} ({row.name}, {row.role}, {row.kind}) created; store it now: it is not shown again",
              file=sys.stderr)
    elif args.action == "revoke":
        try:
            row = auth.revoke(token_id=int(args.which)) if args.which.isdigit() else auth.revoke(name=args.which)
        except AuthError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        audit.record(actor=_operator(), action="tokens.revoke", target=f"token {row.id} {row.name}",
                     after={"revoked": True}, source="llmops token")
        print(f"token {row.id} ({row.name}) revoked")
    else:
        for t in auth.tokens():
            state = "revoked" if t.revoked_at else "active"
            print(f"{t.id:>4}  {t.prefix}…  {t.name:<20} {t.role:<9} {t.kind:<8} {state}")
    return 0


def _help(name: str) -> str:
    return AppConfig.model_fields[name].description or ""


# --- commands that run things -----------------------------------------------------------------------------------


def cmd_engine(args: argparse.Namespace) -> int:
    from engine.app import serve

    serve(_config(args))
    return 0


def _console_command(port: int, engine_url: str, host: str = "127.0.0.1") -> tuple[list[str], dict[str, str]]:
    spec = importlib.util.find_spec("console.server")  # located, not imported: the console is its own process
    if spec is None or spec.origin is None:
        raise SystemExit("the console package is not installed beside the engine (console/server.py not found)")
    app = spec.origin
    cmd = [sys.executable, "-m", "streamlit", "run", app, "--server.port", str(port), "--server.address", host,
           "--server.headless", "true", "--browser.gatherUsageStats", "false", "--client.toolbarMode", "minimal"]
    return cmd, {**os.environ, "LLMOPS_ENGINE_URL": engine_url}


def cmd_console(args: argparse.Namespace) -> int:
    config = _config(args)
    cmd, env = _console_command(config.console_port, args.engine_url or config.engine_url, config.console_host)
    os.execve(cmd[0], cmd, env)


def ensure_admin(config: AppConfig) -> str | None:
    """Create the console's first user, admin, on an empty database; return its generated password (else None)."""
    from engine.access import AuditLog, Auth
    from engine.db import open_database

    db = open_database(config.db_path)
    auth = Auth(db)
    if auth.has_users():
        return None
    password = config.admin_password.get_secret_value() if config.admin_password else None
    generated = auth.ensure_admin(password)
    AuditLog(db).record(actor=_operator(), action="users.create", target="user admin", after={"role": "admin"},
                        source="llmops up")
    return generated


def _banner(engine_url: str, console_url: str, password: str | None, state: str) -> str:
    lines = [f"  engine (OpenAI API at /v1): {engine_url}", f"  console: {console_url}"]
    if password:
        lines.append(f"  console user: admin, password: {password}  (shown by this terminal only; change it on "
                     "the Access page)")
    lines.append(f"  vLLM: {state}. Ctrl-C stops everything.")
    width = max(len(line) for line in lines) + 2
    return "\n" + "=" * width + "\n" + "\n".join(lines) + "\n" + "=" * width + "\n"


def cmd_up(args: argparse.Namespace) -> int:
    """Engine and console as child processes; Ctrl-C stops both (the engine stops vLLM). The URLs and a generated
    admin password are printed last, once the engine answers and again once vLLM is ready, so they stay on screen."""
    config = _config(args)
    engine_url = f"http://127.0.0.1:{config.port}"
    console_url = f"http://127.0.0.1:{config.console_port}"
    ensure_cli_token(config)
    password = ensure_admin(config)  # before the engine starts: it would print a password of its own
    engine_cmd = [sys.executable, "-m", "engine.cli", "engine", "--host", config.host, "--port", str(config.port),
                  "--data-dir", str(config.data_dir)]
    console_cmd, console_env = _console_command(config.console_port, engine_url, config.console_host)
    procs = [subprocess.Popen(engine_cmd), subprocess.Popen(console_cmd, env=console_env,
                                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    stop = False

    def _on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    client = EngineClient(engine_url, token=_cli_token_path(config).read_text().strip())
    deadline = time.monotonic() + 30
    while not stop and not client.healthz() and time.monotonic() < deadline:
        time.sleep(0.2)
    print(_banner(engine_url, console_url, password, "starting; `llmops status --wait 600` follows it"), flush=True)
    announced_ready = False
    while not stop and all(p.poll() is None for p in procs):
        time.sleep(0.5)
        if not announced_ready:
            try:
                announced_ready = client.status().state == "ready"
            except ClientError:
                continue
            if announced_ready:
                print(_banner(engine_url, console_url, password, "ready"), flush=True)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=config.stop_timeout_s + config.drain_timeout_s + 10)
        except subprocess.TimeoutExpired:
            p.kill()
    return 0 if stop else 1


def cmd_demo_model(args: argparse.Namespace) -> int:
    import logging

    from engine.demo_model import build_demo_model

    config = _config(args)
    out = Path(args.out) if args.out else config.demo_model_dir
    if (out / "config.json").exists() and not args.rebuild:
        print(f"demo model already at {out} (--rebuild to train it again)")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_demo_model(out, log_path=config.logs_dir / "demo-model-build.log")
    return 0


# --- commands that talk to the engine ------------------------------------------------------------------------


def _print_revision(rev: RevisionOut) -> None:
    print(f"revision {rev.revision} ({rev.status}{': ' + rev.status_reason if rev.status_reason else ''}) "
          f"by {rev.author} at {rev.created_at:%Y-%m-%d %H:%M:%S} UTC"
          + (f" — {rev.note}" if rev.note else ""))
    values = rev.values.model_dump()
    width = max(len(k) for k in values)
    for key, value in values.items():
        print(f"  {key:<{width}}  {json.dumps(value)}")


class PhasePrinter:
    """Prints a start's phases as they begin, and how the start ended against its ETA (``status --wait``)."""

    def __init__(self) -> None:
        self.seen: set[tuple[int | None, str]] = set()
        self.reason: str | None = None

    def __call__(self, st: StatusOut) -> None:
        view = st.startup
        if st.state != "ready" and st.reason != self.reason and (view is None or view.ready_s is not None):
            self.reason = st.reason
            print(f"  {st.state}: {st.reason}", flush=True)
        if view is None:
            return
        if (view.revision, "") not in self.seen:
            self.seen.add((view.revision, ""))
            eta = f"; expected {view.eta_s:.0f} s ({view.eta_basis})" if view.eta_s is not None else ""
            print(f"revision {view.revision} starting{eta}", flush=True)
        for phase in view.phases:
            if (view.revision, phase.name) not in self.seen:
                self.seen.add((view.revision, phase.name))
                print(f"  +{phase.started_s:5.1f} s  {phase.title}", flush=True)
        if view.ready_s is not None and (view.revision, "ready") not in self.seen:
            self.seen.add((view.revision, "ready"))
            error = f" (ETA error {view.error_s:+.0f} s, {view.error_pct:+.0f} %)" if view.error_s is not None \
                and view.error_pct is not None else ""
            print(f"  +{view.ready_s:5.1f} s  ready{error}", flush=True)
        if view.failed and (view.revision, "failed") not in self.seen:
            self.seen.add((view.revision, "failed"))
            print(f"  +{view.elapsed_s:5.1f} s  failed: {view.failed}", flush=True)


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        st = client.wait_for({"ready"}, args.wait, on_status=None if args.json else PhasePrinter()) \
            if args.wait else client.status()
    if args.json:
        print(st.model_dump_json(indent=2))
        return 0
    print(f"state: {st.state} since {st.since:%H:%M:%S} UTC — {st.reason}")
    print(f"revision: running {st.running_revision}, desired {st.desired_revision}; model {st.model}; "
          f"pid {st.pid}; vLLM {st.vllm_version} ({st.vllm_build})")
    return 0


def _parse_value(raw: str) -> Any:
    if raw.lower() in ("none", "null", ""):
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def cmd_settings(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.action == "show":
            _print_revision(client.settings())
        elif args.action == "history":
            for rev in client.history(args.limit):
                changed = rev.note or ""
                print(f"{rev.revision:>5}  {rev.status:<10} {rev.created_at:%Y-%m-%d %H:%M:%S}  {rev.author:<12} "
                      f"{changed}")
        elif args.action == "rollback":
            plan = client.capacity(client.revision(args.revision).values.model_dump()).plan
            if plan is not None:
                _print_plan(plan)
                if not args.yes and sys.stdin.isatty() and input(
                        f"roll back to revision {args.revision} by this plan? [y/N] ").strip().lower() not in (
                        "y", "yes"):
                    print("nothing written")
                    return 1
            _print_revision(client.rollback(args.revision, args.note or "", force=args.force))
        elif args.action in ("set", "check"):
            changes: dict[str, Any] = {}
            for item in args.pairs:
                key, sep, raw = item.partition("=")
                if not sep:
                    print(f"error: {item!r} is not KEY=VALUE", file=sys.stderr)
                    return 2
                changes[key.strip()] = _parse_value(raw)
            if args.action == "check":
                return _print_capacity(client.capacity(changes))
            base = client.settings()
            plan = client.capacity(changes).plan
            if plan is not None:
                _print_plan(plan)
                ask = not args.yes and sys.stdin.isatty()
                if ask and input("write this revision and apply it by this plan? [y/N] ").strip().lower() not in (
                        "y", "yes"):
                    print("nothing written")
                    return 1
            rev = client.put_settings(base.revision, changes, args.note or "", force=args.force)
            _print_revision(rev)
            for finding in rev.warnings:
                print(f"{finding.severity or 'warning'}: {finding.message}")
            print("the engine applies it with a restart; `llmops status --wait 600` waits for it")
    return 0


def _print_plan(plan: ApplyPlanOut) -> None:
    """How the apply would keep serving (the same plan the console shows before its confirmation)."""
    print(f"plan: {plan.title} ({plan.reason}); {plan.expectation()}. {plan.eta_text()}.")
    if plan.bridge is not None:
        b = plan.bridge
        print(f"  bridge: gpu_memory_utilization {b.gpu_memory_utilization:.2f}, {b.kv_tokens:,} KV tokens, "
              f"max_num_seqs {b.max_num_seqs}")
    for i, step in enumerate(plan.steps, 1):
        print(f"  {i}. {step}")
    for warning in plan.warnings:
        print(f"  warning: {warning}")


def _print_capacity(result: CapacityOut) -> int:
    pred = result.prediction
    if pred:
        print(f"KV cache: {pred.kv_gib} GiB = {pred.kv_tokens:,} tokens ({pred.kv_bytes_per_token:,} B/token); "
              f"weights {pred.weight_gib} GiB; {pred.max_concurrency}x requests of {pred.tokens_per_request:,} "
              "tokens" + ("" if pred.calibrated or pred.device == "cpu" else " (uncalibrated)"))
    for kind, findings in (("error", result.errors), ("warning", result.warnings)):
        for finding in findings:
            fit = ", ".join(f"{k}={v}" for k, v in finding.fit.items())
            print(f"{kind}: {finding.message}" + (f" [fits: {fit}]" if fit else ""))
    if result.plan is not None:
        _print_plan(result.plan)
    return 0 if result.ok else 1


def _settings_epilog() -> str:
    return "fields:\n" + "\n".join(f"  {name}: {field_help(name)}" for name in FIELD_NAMES)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmops", description="Operations console for a vLLM server.")
    sub = parser.add_subparsers(dest="command", required=True)

    def server_opts(p: argparse.ArgumentParser, *names: str) -> None:
        for name in names:
            kind = Path if name == "data_dir" else int if name.endswith("port") else str
            p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None, help=_help(name))

    def client_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--engine-url", default=None, help=_help("engine_url"))
        p.add_argument("--port", type=int, default=None, help="Engine port on 127.0.0.1 (instead of --engine-url).")
        p.add_argument("--token", default=None, help="Bearer token (default: LLMOPS_TOKEN, else the local "
                       "DATA_DIR/run/cli.token that `llmops up` writes).")
        p.add_argument("--data-dir", dest="data_dir", type=Path, default=None, help=_help("data_dir"))

    p = sub.add_parser("up", help="Run the engine and the console; print their URLs.")
    server_opts(p, "host", "port", "console_port", "console_host", "data_dir")
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("engine", help="Run the engine (supervisor, /v1 gateway, /api).")
    server_opts(p, "host", "port", "data_dir")
    p.set_defaults(func=cmd_engine)
    p = sub.add_parser("console", help="Run the Streamlit console.")
    server_opts(p, "console_port", "console_host", "engine_url")
    p.set_defaults(func=cmd_console)
    p = sub.add_parser("demo-model", help="Train the tiny demo model (about 2 minutes on 2 cores, offline).")
    p.add_argument("--out", default=None, help="Folder to write (default: DATA_DIR/models/demo).")
    p.add_argument("--rebuild", action="store_true", help="Train again even if the model exists.")
    server_opts(p, "data_dir")
    p.set_defaults(func=cmd_demo_model)
    p = sub.add_parser("status", help="Engine state, revisions and vLLM version.")
    client_opts(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="Wait until vLLM is ready.")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("settings", help="Show, change, list and roll back settings revisions.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_settings_epilog())
    ssub = p.add_subparsers(dest="action", required=True)
    s = ssub.add_parser("show", help="The desired revision.")
    client_opts(s)
    s = ssub.add_parser("set", help="Write a new revision: KEY=VALUE ...",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_settings_epilog())
    s.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    s.add_argument("--note", default="", help="Why: shown in the history.")
    s.add_argument("--force", action="store_true",
                   help="Write despite pre-flight errors (recorded as forced; automatic rollback still applies).")
    s.add_argument("--yes", "-y", action="store_true",
                   help="Do not ask before writing (a terminal is asked after the apply plan is printed).")
    client_opts(s)
    s = ssub.add_parser("check", help="Pre-flight KEY=VALUE ... without writing: KV cache, errors, warnings.",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_settings_epilog())
    s.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    client_opts(s)
    s = ssub.add_parser("history", help="Revisions, newest first.")
    s.add_argument("--limit", type=int, default=20)
    client_opts(s)
    s = ssub.add_parser("rollback", help="A new revision equal to REV.")
    s.add_argument("revision", type=int, metavar="REV")
    s.add_argument("--note", default="")
    s.add_argument("--force", action="store_true", help="Roll back despite pre-flight errors.")
    s.add_argument("--yes", "-y", action="store_true",
                   help="Do not ask before writing (a terminal is asked after the apply plan is printed).")
    client_opts(s)
    p.set_defaults(func=cmd_settings)

    p = sub.add_parser("token", help="Create, revoke or list API tokens (on the engine's database).")
    tsub = p.add_subparsers(dest="action", required=True)
    t = tsub.add_parser("create", help="Print a new token once.")
    t.add_argument("--role", required=True, choices=["viewer", "prompter", "operator", "admin"])
    t.add_argument("--name", default="token", help="What it is for.")
    t.add_argument("--kind", default="api", choices=["api", "gateway"], help="api: /api routes; gateway: a /v1 key.")
    t.add_argument("--expires-days", type=float, default=None)
    t.add_argument("--rate-limit", type=int, default=None, help="Gateway keys: requests per minute.")
    server_opts(t, "data_dir")
    t = tsub.add_parser("revoke", help="Revoke a token by id or name.")
    t.add_argument("which", metavar="ID|NAME")
    server_opts(t, "data_dir")
    t = tsub.add_parser("list", help="Tokens (never their values).")
    server_opts(t, "data_dir")
    p.set_defaults(func=cmd_token)

    p = sub.add_parser("ctl", help="start | stop | restart vLLM.")
    p.add_argument("action", choices=["start", "stop", "restart"])
    client_opts(p)
    p.set_defaults(func=cmd_ctl)
    return parser


def cmd_ctl(args: argparse.Namespace) -> int:
    with _client(args) as client:
        st = client.engine_action(args.action)
    print(f"{args.action} accepted (state was {st.state})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

