"""The ``llmops`` command line: run the engine and the console, build the demo model, manage settings, tokens,
deployments and the database. One module per kind of subcommand: processes (engine, console, up), local (tokens,
database, demo model: on this machine's files), remote (through the engine's API)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli.common import option_help
from engine.cli.local import cmd_db, cmd_demo_model, cmd_token
from engine.cli.processes import cmd_console, cmd_engine, cmd_up
from engine.cli.remote import cmd_ctl, cmd_deployments, cmd_settings, cmd_status, settings_epilog
from engine.client import ClientError
from engine.errors import DatabaseError
from engine.placement import PlacementError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmops", description="Operations console for a vLLM server.")
    sub = parser.add_subparsers(dest="command", required=True)

    def server_opts(p: argparse.ArgumentParser, *names: str) -> None:
        for name in names:
            kind = Path if name == "data_dir" else int if name.endswith("port") else str
            p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None, help=option_help(name))

    def client_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--engine-url", default=None, help=option_help("engine_url"))
        p.add_argument("--port", type=int, default=None, help="Engine port on 127.0.0.1 (instead of --engine-url).")
        p.add_argument("--token-file", default=None, metavar="PATH", help="File holding the bearer token (mode "
                       "0600). Default: LLMOPS_TOKEN, else the local DATA_DIR/run/cli.token that `llmops up` writes.")
        p.add_argument("--token", default=None, help="Bearer token on the command line: every user of this machine "
                       "can read it (ps); prefer LLMOPS_TOKEN or --token-file.")
        p.add_argument("--data-dir", dest="data_dir", type=Path, default=None, help=option_help("data_dir"))
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
    p = sub.add_parser("demo-model", help="Train the tiny demo model and its demo LoRA adapter (about 2.5 minutes "
                       "on 2 cores, offline; what exists is kept).")
    p.add_argument("--out", default=None, help="Folder to write (default: DATA_DIR/models/demo).")
    p.add_argument("--rebuild", action="store_true", help="Train both again even if they exist.")
    server_opts(p, "data_dir")
    p.set_defaults(func=cmd_demo_model)
    p = sub.add_parser("status", help="Engine state, revisions and vLLM version.")
    client_opts(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="Wait until vLLM is ready.")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("settings", help="Show, change, list and roll back settings revisions.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=settings_epilog())
    ssub = p.add_subparsers(dest="action", required=True)
    s = ssub.add_parser("show", help="The desired revision.")
    client_opts(s)
    s = ssub.add_parser("set", help="Write a new revision: KEY=VALUE ...",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=settings_epilog())
    s.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    s.add_argument("--note", default="", help="Why: shown in the history.")
    s.add_argument("--force", action="store_true",
                   help="Write despite pre-flight errors (recorded as forced; automatic rollback still applies).")
    s.add_argument("--yes", "-y", action="store_true",
                   help="Do not ask before writing (a terminal is asked after the apply plan is printed).")
    client_opts(s)
    s = ssub.add_parser("check", help="Pre-flight KEY=VALUE ... without writing: KV cache, errors, warnings.",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=settings_epilog())
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
    t.add_argument("--kind", default="api", choices=["api", "gateway", "sso"],
                   help="api: /api routes; gateway: a /v1 key; sso: the console's single sign-on credential "
                   "(LLMOPS_CONSOLE_TOKEN; a viewer that opens sessions and does nothing else).")
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
                        "revision).", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=settings_epilog())
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
    except PlacementError as exc:  # a Ray cluster the engine refuses (it asks for no token): what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1
