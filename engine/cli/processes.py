"""Subcommands that run the engine's processes: the engine, the console, or both (``llmops up``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from engine.cli.common import cli_token_path, config_from, ensure_cli_token, open_db, operator
from engine.client import ClientError, EngineClient
from engine.config import AppConfig
from engine.vllm import CHILD_ENV_NAMES


def cmd_engine(args: argparse.Namespace) -> int:
    from engine.app import serve

    serve(config_from(args))
    return 0

# What the console's process inherits of the environment it is started from: what Python and the locale need
# (as for vLLM), Streamlit's own settings, and the LLMOPS_* settings it reads (its heads, hosts and addresses, its
# single sign-on credential) but the engine's secrets: the first admin's password, the hub token, the database URL
# (its password). Nothing else (cloud or database credentials the shell happens to hold).
CONSOLE_ENV_DENIED = frozenset({"LLMOPS_ADMIN_PASSWORD", "LLMOPS_HF_TOKEN", "LLMOPS_DATABASE_URL"})


def console_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items()
            if k in CHILD_ENV_NAMES or k.startswith(("LC_", "STREAMLIT_"))
            or (k.startswith("LLMOPS_") and k not in CONSOLE_ENV_DENIED)}


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
    env = {**console_env(), "LLMOPS_ENGINE_URL": engine_url, "PYTHONPATH": path}
    if key_file is not None:
        env["LLMOPS_CONSOLE_KEY_FILE"] = str(key_file.resolve())
    return cmd, env

def cmd_console(args: argparse.Namespace) -> int:
    config = config_from(args)
    key = config.console_key_path  # there when the engine runs on this machine and data dir
    cmd, env = _console_command(config.console_port, args.engine_url or config.engine_url, config.console_host,
                                key if key.exists() else None)
    os.execve(cmd[0], cmd, env)

def ensure_admin(config: AppConfig) -> str | None:
    """Create the console's first user, admin, on an empty database; return its generated password (else None)."""
    from engine.access import AuditLog, Auth

    db = open_db(config)
    auth = Auth(db)
    if auth.has_users():
        return None
    password = config.admin_password.get_secret_value() if config.admin_password else None
    generated = auth.ensure_admin(password)
    AuditLog(db).record(actor=operator(), action="users.create", target="user admin", after={"role": "admin"},
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

    config = config_from(args)
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
    # (engine/vllm/command.py session_nice); this process passes SIGINT and SIGTERM on to it
    procs = [subprocess.Popen(engine_cmd, start_new_session=True), subprocess.Popen(console_cmd, env=console_env,
                                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    stop = False

    def _on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    client = EngineClient(engine_url, token=cli_token_path(config).read_text().strip())
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
