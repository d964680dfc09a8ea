"""The real engine as a test process: `llmops engine` on a free port and a fresh data dir, the real vLLM (CPU
build here) serving the demo model. A cold start costs about a minute on two cores, so the session shares one
(the ``engine`` fixture in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from console.client import EngineClient
from engine.serving import free_port

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "models" / "demo"
COLD_START_S = 600
ADMIN_PASSWORD = "admin-password-for-tests"
HF_TOKEN = "hf_secret_for_tests_0123456789"  # must reach vLLM's environment and nowhere else


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


def ensure_demo_model() -> Path:
    if not (DEMO / "config.json").exists():
        subprocess.run([sys.executable, "-m", "engine.cli", "demo-model", "--data-dir", str(REPO / "data")],
                       check=True, cwd=REPO)
    return DEMO


def make_token(data_dir: Path, role: str = "admin", name: str = "tests", kind: str = "api") -> str:
    """A token made the way an operator bootstraps one: `llmops token create` on the engine's data dir."""
    out = subprocess.run([sys.executable, "-m", "engine.cli", "token", "create", "--role", role, "--name", name,
                          "--kind", kind, "--data-dir", str(data_dir)], capture_output=True, text=True, check=True,
                         cwd=REPO)
    return out.stdout.strip()


def start_engine(data_dir: Path, *extra_env: tuple[str, str], demo: bool = True) -> EngineHandle:
    """``demo``: link the repository's demo model into the data dir (else the engine finds none: a first run)."""
    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    link = data_dir / "models" / "demo"
    if demo and not link.exists():
        link.symlink_to(ensure_demo_model(), target_is_directory=True)
    port = free_port()
    token = make_token(data_dir)
    env = {**os.environ, "LLMOPS_QUEUE_TIMEOUT_S": "300", "LLMOPS_ADMIN_PASSWORD": ADMIN_PASSWORD,
           "LLMOPS_HF_TOKEN": HF_TOKEN,
           **dict(extra_env)}
    out = open(data_dir / "engine-stdout.log", "wb")  # noqa: SIM115 - lives as long as the engine
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(data_dir), "--port", str(port)],
        stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    client = EngineClient(url, timeout=30, token=token)
    deadline = time.monotonic() + 30
    while not client.healthz():
        assert proc.poll() is None, (data_dir / "engine-stdout.log").read_text()
        assert time.monotonic() < deadline, "engine did not answer /healthz within 30 s"
        time.sleep(0.2)
    return EngineHandle(url, port, data_dir, proc, client, token)


def stop_engine(handle: EngineHandle) -> None:
    handle.proc.terminate()
    try:
        handle.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        handle.proc.kill()
        raise
    handle.client.close()
