"""A throwaway PostgreSQL server for the tests: Debian's server binaries (initdb, pg_ctl), a data dir and a unix
socket dir of its own under /tmp, no TCP, trust authentication, no fsync (nothing in it outlives the tests).

``PostgresServer`` starts and stops one; ``fresh_database`` gives each test its own database, copied from a
template that is migrated to head once (a copy costs a fraction of migrating). Where the server binaries are
missing the tests that need them skip, saying so, except under CI (``LLMOPS_REQUIRE_POSTGRES=1``, set by .ci/run),
where missing means fail. As root (the dev container) the server runs as the ``postgres`` user through runuser.
"""

from __future__ import annotations

import itertools
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from engine.db import open_database

TEMPLATE = "llmops_template"
_names = itertools.count(1)


def find_bindir() -> Path | None:
    """The folder of initdb and pg_ctl: LLMOPS_TEST_POSTGRES_BIN, else Debian's newest /usr/lib/postgresql/N/bin,
    else the PATH."""
    given = os.environ.get("LLMOPS_TEST_POSTGRES_BIN")
    if given:
        return Path(given) if (Path(given) / "pg_ctl").is_file() else None
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    if found:
        return found[-1].parent
    which = shutil.which("pg_ctl")
    return Path(which).parent if which else None


def required() -> bool:
    return os.environ.get("LLMOPS_REQUIRE_POSTGRES") == "1"


def bindir_or_skip() -> Path:
    """The server binaries, or skip (fail under CI) with the reason and how to get them."""
    bindir = find_bindir()
    if bindir is None:
        why = ("no PostgreSQL server binaries (initdb, pg_ctl) on this machine: `apt-get install postgresql`, or set "
               "LLMOPS_TEST_POSTGRES_BIN to their folder")
        if required():
            pytest.fail(f"LLMOPS_REQUIRE_POSTGRES=1 but {why}")
        pytest.skip(why)
    return bindir


class PostgresServer:
    """One PostgreSQL server on a unix socket in a fresh temporary folder."""

    def __init__(self, bindir: Path, port: int = 5432) -> None:
        self.bindir = bindir
        self.port = port
        self.root = Path(tempfile.mkdtemp(prefix="llmops-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "sock"
        self.log = self.root / "server.log"
        self.socket_dir.mkdir()
        self._as: list[str] = []
        if os.geteuid() == 0:  # the server refuses to run as root: it runs as postgres, which owns its folders
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root, and there is no postgres user to run the server as") from None
            for path in (self.root, self.socket_dir):
                os.chown(path, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync",
                  "--no-instructions")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self._as, str(self.bindir / tool), *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = (f"-k {self.socket_dir} -p {self.port} -c listen_addresses='' -c fsync=off "
                   "-c full_page_writes=off -c synchronous_commit=off -c max_connections=300 -c shared_buffers=32MB")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def stop(self) -> None:
        """A fast shutdown: sessions are disconnected, as in a restart of the server under the engine."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def remove(self) -> None:
        if self.running():
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@/{database}?host={self.socket_dir}&port={self.port}"

    def admin(self, sql: str) -> None:
        """One statement on the maintenance database, outside a transaction (CREATE/DROP DATABASE)."""
        import psycopg

        with psycopg.connect(host=str(self.socket_dir), port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(sql.encode())

    def create_database(self, name: str, template: str | None = None) -> str:
        assert re.fullmatch(r"[a-z0-9_]+", name), name
        self.admin(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # FORCE: connections a test left open


def migrated_template(server: PostgresServer) -> str:
    """The template database, migrated to head by the engine's own open_database (once per server)."""
    marker = server.root / "template-ready"
    if not marker.exists():
        server.drop_database(TEMPLATE)
        open_database(server.create_database(TEMPLATE)).close()
        marker.touch()
    return TEMPLATE


def fresh_database(server: PostgresServer, prefix: str = "t") -> tuple[str, str]:
    """A new database at the schema's head (a copy of the template): its name and URL."""
    name = f"{prefix}_{os.getpid()}_{next(_names)}"
    return name, server.create_database(name, template=migrated_template(server))


_SHARED: list[PostgresServer] = []


def shared_server() -> PostgresServer | None:
    """The test process's one server, started on first use and removed when the process ends (None where there
    are no server binaries: the caller skips, or fails under CI)."""
    if not _SHARED:
        bindir = find_bindir()
        if bindir is None:
            return None
        import atexit

        server = PostgresServer(bindir)
        server.start()
        atexit.register(server.remove)
        _SHARED.append(server)
    return _SHARED[0]
