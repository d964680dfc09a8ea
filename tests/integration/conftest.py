"""One real engine per test session: `llmops engine` on a free port, a fresh data dir, the real vLLM (CPU build
here) serving the demo model. A cold start costs about a minute on two cores, so tests share it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from console.client import EngineClient
from engine.child import free_port

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "models" / "demo"
COLD_START_S = 600


@dataclass
class EngineHandle:
    url: str
    port: int
    data_dir: Path
    proc: subprocess.Popen[bytes]
    client: EngineClient

    def vllm_log(self) -> str:
        return (self.data_dir / "logs" / "vllm.log").read_text(errors="replace")


def ensure_demo_model() -> Path:
    if not (DEMO / "config.json").exists():
        subprocess.run([sys.executable, "-m", "engine.cli", "demo-model", "--data-dir", str(REPO / "data")],
                       check=True, cwd=REPO)
    return DEMO


def start_engine(data_dir: Path, *extra_env: tuple[str, str]) -> EngineHandle:
    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    link = data_dir / "models" / "demo"
    if not link.exists():
        link.symlink_to(ensure_demo_model(), target_is_directory=True)
    port = free_port()
    env = {**os.environ, "LLMOPS_QUEUE_TIMEOUT_S": "300", **dict(extra_env)}
    out = open(data_dir / "engine-stdout.log", "wb")  # noqa: SIM115 - lives as long as the engine
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(data_dir), "--port", str(port)],
        stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    client = EngineClient(url, timeout=30)
    deadline = time.monotonic() + 30
    while not client.healthz():
        assert proc.poll() is None, (data_dir / "engine-stdout.log").read_text()
        assert time.monotonic() < deadline, "engine did not answer /healthz within 30 s"
        time.sleep(0.2)
    return EngineHandle(url, port, data_dir, proc, client)


def stop_engine(handle: EngineHandle) -> None:
    handle.proc.terminate()
    try:
        handle.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        handle.proc.kill()
        raise
    handle.client.close()


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    handle = start_engine(tmp_path_factory.mktemp("engine"))
    try:
        handle.client.wait_for({"ready"}, COLD_START_S)
        yield handle
    finally:
        stop_engine(handle)
