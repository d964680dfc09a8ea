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
from typing import TYPE_CHECKING, Any

from engine.client import ClientError, EngineClient
from engine.config import AppConfig
from engine.errors import DatabaseError
from engine.revisions import FIELD_NAMES, field_help
from engine.schemas import ApplyPlanOut, CapacityOut, RevisionOut, StatusOut, shown

if TYPE_CHECKING:
    from engine.db import Database


def _config(args: argparse.Namespace) -> AppConfig:
    overrides = {k: v for k, v in vars(args).items() if k in AppConfig.model_fields and v is not None}
    return AppConfig(**overrides)


def _token(args: argparse.Namespace) -> str | None:
    """The bearer token: --token-file, --token (with a warning: every user of this machine sees a command line),
    LLMOPS_TOKEN, else the local DATA_DIR/run/cli.token."""
    if (file := getattr(args, "token_file", None)) is not None:
        path = Path(file)
        try:
            if path.stat().st_mode & 0o077:
                print(f"warning: {path} can be read by other users of this machine: chmod 600 it", file=sys.stderr)
            return path.read_text().strip()
        except OSError as exc:
            raise SystemExit(f"error: cannot read the token file {path}: {exc.strerror}") from None
    if token := getattr(args, "token", None):
        print("warning: --token is visible to every user of this machine (ps, /proc): use LLMOPS_TOKEN or "
              "--token-file instead", file=sys.stderr)
        return str(token)
    if token := os.environ.get("LLMOPS_TOKEN"):
        return token
    path = _cli_token_path(AppConfig(**({"data_dir": args.data_dir} if getattr(args, "data_dir", None) else {})))
    return path.read_text().strip() if path.exists() else None


def _client(args: argparse.Namespace) -> EngineClient:
    url = args.engine_url or (f"http://127.0.0.1:{args.port}" if getattr(args, "port", None) else None)
    return EngineClient(url or AppConfig().engine_url, token=_token(args) or "",
                        deployment=getattr(args, "deployment", None))


def _open_db(config: AppConfig) -> Database:
    """The engine's database, opened by the CLI as the engine opens it: the data dir 0700, its files 0600 (on a
    fresh data dir the CLI left them 0644 and 0755)."""
    from engine.db import open_database
    from engine.private import make_private

    os.umask(0o077)
    make_private(config.data_dir)
    db = open_database(config.database)
    make_private(config.data_dir)  # the database's files now exist
    return db


def _cli_token_path(config: AppConfig) -> Path:
    """A local admin token for the CLI on the engine's machine (mode 0600), written by `llmops up`."""
    return config.data_dir / "run" / "cli.token"


def _operator() -> str:
    """Who runs the command on this machine (the audit's actor for what the CLI does on the database)."""
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "cli"


def ensure_cli_token(config: AppConfig) -> Path:
    from engine.access import AuditLog, Auth

    path = _cli_token_path(config)
    if not path.exists():
        db = _open_db(config)
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
    from engine.access import AuditLog, Auth, AuthError, token_state

    db = _open_db(_config(args))
    auth, audit = Auth(db), AuditLog(db)
    if args.action == "create":
        limited = [n.strip() for n in args.deployments.split(",") if n.strip()] if args.deployments else None
        if limited is not None:
            from engine.deployments import DeploymentStore

            known = {d.name for d in DeploymentStore(db).all()}
            if unknown := [n for n in limited if n not in known]:
                print(f"error: --deployments: no deployment named {shown(unknown[0])} (llmops deployments list)",
                      file=sys.stderr)
                return 2
        try:
            token, row = auth.create_token(args.name, args.role, args.kind, created_by=_operator(),
                                           ttl_s=args.expires_days * 86400 if args.expires_days else None,
                                           rate_limit_per_min=args.rate_limit, deployments=limited)
        except AuthError as exc:
            print(f"error: {shown(str(exc))}", file=sys.stderr)
            return 2
        audit.record(actor=_operator(), action="tokens.create", target=f"token {row.id} {row.name}",
                     after={"role": row.role, "kind": row.kind, "prefix": row.prefix}, source="llmops token")
        print(token)  # its only copy
        print(f"token {row.id} ({shown(row.name)}, {row.role}, {row.kind}) created; store it now: it is not shown "
              "again", file=sys.stderr)
    elif args.action == "revoke":
        try:
            row = auth.revoke(token_id=int(args.which)) if args.which.isdigit() else auth.revoke(name=args.which)
        except AuthError as exc:
            print(f"error: {shown(str(exc))}", file=sys.stderr)
            return 1
        audit.record(actor=_operator(), action="tokens.revoke", target=f"token {row.id} {row.name}",
                     after={"revoked": True}, source="llmops token")
        print(f"token {row.id} ({shown(row.name)}) revoked")
    else:  # names are escaped: one made before names were checked may hold a newline or an ANSI sequence
        for t in auth.tokens():
            print(f"{t.id:>4}  {t.prefix}…  {shown(t.name):<20} {t.role:<9} {t.kind:<8} {token_state(t)}")
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    """The engine's database: its schema revision, the upgrade the engine also runs at start, a new revision."""
    from engine.db import UNAVAILABLE, Database, open_database, schema

    config = _config(args)
    if args.action == "revision":
        path = schema.new_revision(args.message, autogenerate=not args.empty)
        if path is None:
            print("nothing to migrate: engine/db/tables.py declares what the newest revision makes (--empty writes "
                  "a revision to fill in by hand)")
            return 1
        print(f"wrote {path}: read it, then run `pytest tests/service/test_schema.py` (and `make test` for PostgreSQL)")
        return 0
    if args.action == "upgrade":
        db = open_database(config.database)
        try:
            with db.engine.connect() as conn:
                now = schema.current(conn)
        finally:
            db.close()
        done = f"upgraded through {', '.join(db.applied)}" if db.applied else "already up to date"
        print(f"database {db.where}: schema at revision {', '.join(now)} ({done})")
        return 0
    if isinstance(config.database, Path) and not config.database.exists():
        print(f"no database at {config.database} yet: the engine (or `llmops db upgrade`) creates it")
        return 1
    db = Database(config.database)
    try:
        with db.engine.connect() as conn:
            found = schema.current(conn)
    except UNAVAILABLE as exc:
        raise db.unreachable(exc) from None
    finally:
        db.close()
    newest = schema.head()
    if found == [newest]:
        state = "up to date"
    elif not found:
        state = "not stamped (empty, or made before migrations): `llmops db upgrade` adopts it"
    elif all(r in schema.known() for r in found):
        state = f"behind: `llmops db upgrade` (or starting the engine) applies {', '.join(schema.pending(found))}"
    else:
        state = "newer than this engine: it was written by a newer llmops, which this one will not open"
    print(f"database {db.where}: schema at revision {', '.join(found) or 'none'}; this engine's newest is {newest} "
          f"({state})")
    return 0 if found == [newest] or not args.check else 1


def _help(name: str) -> str:
    return AppConfig.model_fields[name].description or ""


# --- commands that run things -----------------------------------------------------------------------------------


def cmd_engine(args: argparse.Namespace) -> int:
    from engine.app import serve

    serve(_config(args))
    return 0


def _console_command(port: int, engine_url: str, host: str = "127.0.0.1",
                     key_file: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The console's process: console/serve.py (uvicorn with the engine's bounded, timed heads and Host check in
    front of console/server.py's app), not `streamlit run`, whose server reads heads of any size. ``key_file``:
    the engine's console key (DATA_DIR/run/console.key), with which the console passes a browser's address to
    the engine for the audit."""
    spec = importlib.util.find_spec("console.serve")  # located, not imported: the console is its own process
    if spec is None or spec.origin is None:
        raise SystemExit("the console package is not installed beside the engine (console/serve.py not found)")
    root = str(Path(spec.origin).resolve().parent.parent)  # where this process found it, found there again
    path = os.pathsep.join(dict.fromkeys([root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    cmd = [sys.executable, "-m", "console.serve", "--port", str(port), "--host", host]
    env = {**os.environ, "LLMOPS_ENGINE_URL": engine_url, "PYTHONPATH": path}
    if key_file is not None:
        env["LLMOPS_CONSOLE_KEY_FILE"] = str(key_file.resolve())
    return cmd, env


def cmd_console(args: argparse.Namespace) -> int:
    config = _config(args)
    key = config.console_key_path  # there when the engine runs on this machine and data dir
    cmd, env = _console_command(config.console_port, args.engine_url or config.engine_url, config.console_host,
                                key if key.exists() else None)
    os.execve(cmd[0], cmd, env)


def ensure_admin(config: AppConfig) -> str | None:
    """Create the console's first user, admin, on an empty database; return its generated password (else None)."""
    from engine.access import AuditLog, Auth

    db = _open_db(config)
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
    from engine.access import ensure_console_key

    config = _config(args)
    engine_url = f"http://127.0.0.1:{config.port}"
    console_url = f"http://127.0.0.1:{config.console_port}"
    ensure_cli_token(config)
    password = ensure_admin(config)  # before the engine starts: it would print a password of its own
    ensure_console_key(config.console_key_path)  # before the console starts: it is handed the key's path
    engine_cmd = [sys.executable, "-m", "engine.cli", "engine", "--host", config.host, "--port", str(config.port),
                  "--data-dir", str(config.data_dir)]
    console_cmd, console_env = _console_command(config.console_port, engine_url, config.console_host,
                                                config.console_key_path)
    # the engine leads a session of its own, so that its CPU priority (engine_nice) weighs against vLLM's sessions
    # (engine/serving/command.py session_nice); this process passes SIGINT and SIGTERM on to it
    procs = [subprocess.Popen(engine_cmd, start_new_session=True), subprocess.Popen(console_cmd, env=console_env,
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
          f"by {shown(rev.author)} at {rev.created_at:%Y-%m-%d %H:%M:%S} UTC"
          + (f" — {shown(rev.note)}" if rev.note else ""))
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
                print(f"{rev.revision:>5}  {rev.status:<10} {rev.created_at:%Y-%m-%d %H:%M:%S}  "
                      f"{shown(rev.author):<12} {shown(changed)}")
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
    if plan.step_etas:
        for i, s in enumerate(plan.step_etas, 1):
            print(f"  {i}. {s.text}: " + (f"about {s.eta_s:.0f} s ({s.basis})" if s.eta_s is not None else
                                         f"time not known ({s.basis})"))
    else:
        for i, step in enumerate(plan.steps, 1):
            print(f"  {i}. {step}")
    if plan.eta_note:
        print(f"  about these times: {plan.eta_note}")
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
        p.add_argument("--token-file", default=None, metavar="PATH", help="File holding the bearer token (mode "
                       "0600). Default: LLMOPS_TOKEN, else the local DATA_DIR/run/cli.token that `llmops up` writes.")
        p.add_argument("--token", default=None, help="Bearer token on the command line: every user of this machine "
                       "can read it (ps); prefer LLMOPS_TOKEN or --token-file.")
        p.add_argument("--data-dir", dest="data_dir", type=Path, default=None, help=_help("data_dir"))
        p.add_argument("--deployment", "-d", default=None, metavar="NAME",
                       help="The deployment to act on (name or id; default: the default deployment).")

    p = sub.add_parser("up", help="Run the engine and the console; print their URLs.")
    server_opts(p, "host", "port", "console_port", "console_host", "data_dir")
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("engine", help="Run the engine (controller, /v1 gateway, /api).")
    server_opts(p, "host", "port", "data_dir")
    p.set_defaults(func=cmd_engine)
    p = sub.add_parser("console", help="Run the Streamlit console.")
    server_opts(p, "console_port", "console_host", "engine_url", "data_dir")
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
    t.add_argument("--deployments", default=None, metavar="NAME[,NAME...]",
                   help="Gateway keys: the deployments it may send requests to (default: every one).")
    server_opts(t, "data_dir")
    t = tsub.add_parser("revoke", help="Revoke a token by id or name.")
    t.add_argument("which", metavar="ID|NAME")
    server_opts(t, "data_dir")
    t = tsub.add_parser("list", help="Tokens (never their values).")
    server_opts(t, "data_dir")
    p.set_defaults(func=cmd_token)

    p = sub.add_parser("deployments", help="List, create, enable, disable or delete deployments (several models).")
    dsub = p.add_subparsers(dest="action", required=True)
    d = dsub.add_parser("list", help="Every deployment with its state and revisions.")
    client_opts(d)
    d = dsub.add_parser("create", help="A new deployment: NAME model=… [KEY=VALUE …] (the settings of its first "
                        "revision).", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_settings_epilog())
    d.add_argument("name", metavar="NAME", help="The model name clients will send.")
    d.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    d.add_argument("--gpus", default=None, help="GPU indices it runs on, e.g. 0 or 0,1 (default: placed for it).")
    d.add_argument("--disabled", action="store_true", help="Create it without starting it.")
    d.add_argument("--note", default="")
    d.add_argument("--force", action="store_true", help="Create it despite pre-flight errors.")
    client_opts(d)
    for action in ("enable", "disable", "delete"):
        d = dsub.add_parser(action, help=f"{action.capitalize()} a deployment"
                            + (" (its instances stop; its revisions, events and benchmarks go)" if action == "delete"
                               else "."))
        d.add_argument("name", metavar="NAME")
        if action == "delete":
            d.add_argument("--yes", "-y", action="store_true", help="Do not ask (a terminal is asked).")
        client_opts(d)
    p.set_defaults(func=cmd_deployments)
    p = sub.add_parser("db", help="The engine's database: schema revision, upgrade, new migration.",
                       description="The database is DATA_DIR/llmops.db (SQLite), or LLMOPS_DATABASE_URL (PostgreSQL: "
                       "postgresql://USER:PASSWORD@HOST:PORT/DBNAME). The engine upgrades it at start as well.")
    dsub = p.add_subparsers(dest="action", required=True)
    d = dsub.add_parser("upgrade", help="Bring the schema to this engine's newest revision (what a start does).")
    server_opts(d, "data_dir")
    d = dsub.add_parser("current", help="The database's schema revision against this engine's newest; changes "
                        "nothing.")
    d.add_argument("--check", action="store_true", help="Exit 1 unless the database is at the newest revision.")
    server_opts(d, "data_dir")
    d = dsub.add_parser("revision", help="For developers: write a new migration for what engine/db/tables.py "
                        "declares beyond the newest revision (autogenerated against a scratch SQLite database).")
    d.add_argument("-m", "--message", required=True, help="What changes, e.g. \"token owners\".")
    d.add_argument("--empty", action="store_true", help="An empty revision to fill in by hand (data migrations).")
    p.set_defaults(func=cmd_db)

    p = sub.add_parser("ctl", help="start | stop | restart vLLM.")
    p.add_argument("action", choices=["start", "stop", "restart"])
    client_opts(p)
    p.set_defaults(func=cmd_ctl)
    return parser


def _pairs(items: list[str]) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            print(f"error: {item!r} is not KEY=VALUE", file=sys.stderr)
            return None
        out[key.strip()] = _parse_value(raw)
    return out


def cmd_deployments(args: argparse.Namespace) -> int:
    args.deployment = None  # these commands name their deployment themselves
    with _client(args) as client:
        if args.action == "list":
            for d in client.deployments():
                mark = "*" if d.default else " "
                print(f"{mark}{d.id:>3}  {d.name:<24} {'enabled ' if d.enabled else 'disabled'} {d.state:<9} "
                      f"running {d.running_revision} desired {d.desired_revision}  {d.model}"
                      + (f"  gpus {','.join(map(str, d.gpus))}" if d.gpus else ""))
            return 0
        if args.action == "create":
            values = _pairs(args.pairs)
            if values is None:
                return 2
            gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
            made = client.create_deployment(args.name, values, gpus=gpus, enabled=not args.disabled,
                                            note=args.note or "", force=args.force)
            print(f"deployment {made.id} {made.name} created with revision {made.revision}: {made.reason}")
            for warning in made.warnings:
                print(f"warning: {warning.get('message')}")
            return 0
        if args.action in ("enable", "disable"):
            done = client.update_deployment(args.name, enabled=args.action == "enable")
            print(f"deployment {done.name} {args.action}d")
            return 0
        gone = client.deletion(args.name)
        print(f"deleting {gone.name} stops its instances and removes {gone.revisions} revisions, {gone.events} "
              f"events, {gone.benchmarks} benchmarks and {gone.requests} ledger rows (the audit keeps its records)")
        if not args.yes and sys.stdin.isatty() and input("delete it? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
        client.delete_deployment(args.name, confirm=gone.name)
        print(f"deployment {gone.name} deleted")
    return 0


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
    except DatabaseError as exc:  # unreachable, unsupported, or written by a newer engine: what to do, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1

