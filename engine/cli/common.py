"""What every subcommand of the ``llmops`` command line shares: its settings from the arguments, the bearer token,
the typed client of the engine's API, the engine's database opened as the engine opens it, and the local CLI token."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.client import EngineClient
from engine.config import AppConfig

if TYPE_CHECKING:
    from engine.db import Database


def config_from(args: argparse.Namespace) -> AppConfig:
    overrides = {k: v for k, v in vars(args).items() if k in AppConfig.model_fields and v is not None}
    return AppConfig(**overrides)

def token_from(args: argparse.Namespace) -> str | None:
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
    path = cli_token_path(AppConfig(**({"data_dir": args.data_dir} if getattr(args, "data_dir", None) else {})))
    return path.read_text().strip() if path.exists() else None

def client_from(args: argparse.Namespace) -> EngineClient:
    url = args.engine_url or (f"http://127.0.0.1:{args.port}" if getattr(args, "port", None) else None)
    return EngineClient(url or AppConfig().engine_url, token=token_from(args) or "",
                        deployment=getattr(args, "deployment", None))

def open_db(config: AppConfig) -> Database:
    """The engine's database, opened by the CLI as the engine opens it: the data dir 0700, its files 0600 (on a
    fresh data dir the CLI left them 0644 and 0755)."""
    from engine.db import open_database
    from engine.private import make_private

    os.umask(0o077)
    make_private(config.data_dir)
    db = open_database(config.database)
    make_private(config.data_dir)  # the database's files now exist
    return db

def cli_token_path(config: AppConfig) -> Path:
    """A local admin token for the CLI on the engine's machine (mode 0600), written by `llmops up`."""
    return config.data_dir / "run" / "cli.token"

def operator() -> str:
    """Who runs the command on this machine (the audit's actor for what the CLI does on the database)."""
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "cli"

def ensure_cli_token(config: AppConfig) -> Path:
    from engine.access import AuditLog, Auth

    path = cli_token_path(config)
    if not path.exists():
        db = open_db(config)
        token, row = Auth(db).create_token("local-cli", "admin", created_by="llmops up")
        AuditLog(db).record(actor=operator(), action="tokens.create", target=f"token {row.id} {row.name}",
                            after={"role": row.role, "kind": row.kind, "prefix": row.prefix}, source="llmops up")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    return path

def option_help(name: str) -> str:
    return AppConfig.model_fields[name].description or ""


# --- commands that run things -----------------------------------------------------------------------------------
