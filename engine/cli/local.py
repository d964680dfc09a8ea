"""Subcommands that act on the engine's own files, on this machine: API tokens on its database (how the first one
is made), the database's schema, the demo model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli.common import config_from, open_db, operator
from engine.schemas import shown


def cmd_token(args: argparse.Namespace) -> int:
    """Tokens are managed on the engine's own database: this is how the first one is made."""
    from engine.access import AuditLog, Auth, AuthError, token_state

    db = open_db(config_from(args))
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
            token, row = auth.create_token(args.name, args.role, args.kind, created_by=operator(),
                                           ttl_s=args.expires_days * 86400 if args.expires_days else None,
                                           rate_limit_per_min=args.rate_limit, deployments=limited)
        except AuthError as exc:
            print(f"error: {shown(str(exc))}", file=sys.stderr)
            return 2
        audit.record(actor=operator(), action="tokens.create", target=f"token {row.id} {row.name}",
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
        audit.record(actor=operator(), action="tokens.revoke", target=f"token {row.id} {row.name}",
                     after={"revoked": True}, source="llmops token")
        print(f"token {row.id} ({shown(row.name)}) revoked")
    else:  # names are escaped: one made before names were checked may hold a newline or an ANSI sequence
        for t in auth.tokens():
            print(f"{t.id:>4}  {t.prefix}…  {shown(t.name):<20} {t.role:<9} {t.kind:<8} {token_state(t)}")
    return 0

def cmd_db(args: argparse.Namespace) -> int:
    """The engine's database: its schema revision, the upgrade the engine also runs at start, a new revision."""
    from engine.db import UNAVAILABLE, Database, open_database, schema

    config = config_from(args)
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

def cmd_demo_model(args: argparse.Namespace) -> int:
    """The demo model, then its LoRA adapter beside it (models/demo-lora): each built when missing (or --rebuild),
    so a data dir made before the adapter existed gains it without training the model again."""
    import logging

    config = config_from(args)
    out = Path(args.out) if args.out else config.demo_model_dir
    adapter = out.parent / "demo-lora"
    model_there = (out / "config.json").exists() and not args.rebuild
    adapter_there = (adapter / "adapter_config.json").exists() and not args.rebuild
    if model_there and adapter_there:
        print(f"demo model already at {out}, its adapter at {adapter} (--rebuild to train them again)")
        return 0
    from engine.demo_model import build_demo_lora, build_demo_model  # torch: only when there is something to build

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if model_there:
        print(f"demo model already at {out}; building its adapter")
    else:
        build_demo_model(out, log_path=config.logs_dir / "demo-model-build.log")
    build_demo_lora(out, adapter, log_path=config.logs_dir / "demo-lora-build.log")
    return 0


# --- commands that talk to the engine ------------------------------------------------------------------------
