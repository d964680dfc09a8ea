"""The one engine harness of the CPU and GPU suites: the real engine (``llmops engine``) as a process on a free
port and its own data dir, with the real vLLM behind it. ``running_engine`` starts it, waits for /healthz (failing
at once, with its output, if the process dies), and stops it terminate → kill, whatever happens in between.

A cold start of vLLM costs about a minute on two cores, so the CPU suites share one (the ``engine`` fixture of
tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.client import EngineClient
from engine.vllm import free_port
from tests.testkit.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "models" / "demo"
COLD_START_S = 600
ADMIN_PASSWORD = "admin-password-for-tests"
HF_TOKEN = "hf_secret_for_tests_0123456789"  # must reach vLLM's environment and nowhere else
# secrets of the engine's own environment that must not reach vLLM's (an outside probe found the console's admin
# token there): the engine runs with them, vLLM's /proc/<pid>/environ is read for them
ENGINE_ONLY_ENV = {"LLMOPS_CONSOLE_TOKEN": "llmops_console_token_for_tests", "AWS_SECRET_ACCESS_KEY": "aws-secret",
                   "PGPASSWORD": "pg-secret"}


@dataclass
class EngineHandle:
    url: str
    port: int
    data_dir: Path
    proc: subprocess.Popen[bytes]
    client: EngineClient
    token: str  # an admin API token, made with `llmops token create` before the engine started

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    def vllm_log(self) -> str:
        return (self.data_dir / "logs" / "vllm.log").read_text(errors="replace")

    def output(self) -> str:
        path = self.data_dir / "engine-stdout.log"
        return path.read_text(errors="replace") if path.exists() else ""


def ensure_demo_model() -> Path:
    if not (DEMO / "config.json").exists():
        subprocess.run([sys.executable, "-m", "engine.cli", "demo-model", "--data-dir", str(REPO / "data")],
                       check=True, cwd=REPO)
    return DEMO


def ensure_demo_lora() -> Path:
    """The demo model's LoRA adapter (data/models/demo-lora), built beside the model when missing."""
    adapter = DEMO.parent / "demo-lora"
    if not (adapter / "adapter_config.json").exists():
        subprocess.run([sys.executable, "-m", "engine.cli", "demo-model", "--data-dir", str(REPO / "data")],
                       check=True, cwd=REPO)
    return adapter


def instance_headers(pid: int | None) -> dict[str, str]:
    """The header with the key the engine gave one of its vLLM servers (VLLM_API_KEY, in its environment only,
    readable by the same user on the same host): every path of the server asks for it (engine/vllm_guard.py)."""
    if pid is None:
        return {}
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    key = next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"VLLM_API_KEY=")), None)
    return {"authorization": f"Bearer {key}"} if key else {}


def make_token(data_dir: Path, role: str = "admin", name: str = "tests", kind: str = "api",
               env: Mapping[str, str] | None = None) -> str:
    """A token made the way an operator bootstraps one: `llmops token create` on the engine's data dir (and its
    database: ``env`` may name one in LLMOPS_DATABASE_URL)."""
    out = subprocess.run([sys.executable, "-m", "engine.cli", "token", "create", "--role", role, "--name", name,
                          "--kind", kind, "--data-dir", str(data_dir)], capture_output=True, text=True, check=True,
                         cwd=REPO, env={**os.environ, **(env or {})})
    return out.stdout.strip()


@contextmanager
def running_engine(data_dir: Path, env: Mapping[str, str] | None = None, *, demo: bool = True,
                   timeout: float = 60) -> Iterator[EngineHandle]:
    """The engine on a free port and ``data_dir``, until the block ends. ``demo``: link the repository's demo model
    into the data dir (else the engine finds none: a first run). ``env`` adds LLMOPS_* settings."""
    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    link = data_dir / "models" / "demo"
    if demo and not link.exists():
        link.symlink_to(ensure_demo_model(), target_is_directory=True)
    port = free_port()
    token = make_token(data_dir, env=env)
    full_env = {**os.environ, "LLMOPS_QUEUE_TIMEOUT_S": "300", "LLMOPS_ADMIN_PASSWORD": ADMIN_PASSWORD,
                "LLMOPS_HF_TOKEN": HF_TOKEN, "LLMOPS_MODEL_ROOTS": json.dumps([str(DEMO.parent)]), **ENGINE_ONLY_ENV,
                **(env or {})}
    with open(data_dir / "engine-stdout.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(data_dir),
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=full_env)
    url = f"http://127.0.0.1:{port}"
    client = EngineClient(url, timeout=60, token=token)
    handle = EngineHandle(url, port, data_dir, proc, client, token)
    try:
        def up() -> bool:
            assert proc.poll() is None, f"the engine exited with {proc.returncode}:\n{handle.output()[-3000:]}"
            return client.healthz()

        wait_until(up, timeout, what="the engine's /healthz")
        yield handle
    finally:
        stop(handle)


def stop(handle: EngineHandle, timeout: float = 120) -> None:
    """SIGTERM, a bounded wait (the engine drains and stops vLLM), then SIGKILL."""
    if handle.proc.poll() is None:
        handle.proc.send_signal(signal.SIGTERM)
        try:
            handle.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            handle.proc.kill()
            handle.proc.wait(timeout=10)
            raise AssertionError(f"the engine did not stop within {timeout:.0f} s of SIGTERM") from None
    handle.client.close()
