"""The CLI against a real engine process on a non-default port and data dir (vLLM not started: autostart off)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testkit.engine import REPO, EngineHandle, running_engine

# the CLI's parsing and messages over HTTP (the store's writes are test_access's and test_api's)
pytestmark = pytest.mark.one_database


@pytest.fixture
def idle_engine(data_dir: Path) -> Iterator[EngineHandle]:
    with running_engine(data_dir, {"LLMOPS_AUTOSTART": "false"}) as handle:
        yield handle


def llmops(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMOPS_TOKEN": token} if token else {k: v for k, v in os.environ.items()
                                                                  if k != "LLMOPS_TOKEN"}
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=60, env=env)


def test_settings_set_show_history_rollback(idle_engine: EngineHandle) -> None:
    port = str(idle_engine.port)
    out = llmops("settings", "set", "max_num_seqs=3", "enforce_eager=true", "--note", "from the cli", "--port", port,
                 token=idle_engine.token)
    assert out.returncode == 0, out.stderr
    assert "revision 2 (pending)" in out.stdout
    assert "plan: Start" in out.stdout  # the apply plan, printed before the write (nothing runs yet: a start)
    show = llmops("settings", "show", "--port", port, token=idle_engine.token).stdout
    assert "max_num_seqs" in show and "3" in show and "from the cli" in show
    assert idle_engine.client.settings().values.enforce_eager is True
    history = llmops("settings", "history", "--port", port, token=idle_engine.token).stdout.splitlines()
    assert [line.split()[0] for line in history] == ["2", "1"]
    assert llmops("settings", "rollback", "1", "--port", port, token=idle_engine.token).returncode == 0
    assert idle_engine.client.settings().values.max_num_seqs == 16


def test_bad_value_is_reported_per_field(idle_engine: EngineHandle) -> None:
    out = llmops("settings", "set", "gpu_memory_utilization=3", "--port", str(idle_engine.port),
                 token=idle_engine.token)
    assert out.returncode == 1
    assert "gpu_memory_utilization" in out.stderr and "less than or equal to 1" in out.stderr
    assert idle_engine.client.settings().revision == 1


def test_status_and_unreachable_engine(idle_engine: EngineHandle) -> None:
    out = llmops("status", "--port", str(idle_engine.port), token=idle_engine.token)
    assert out.returncode == 0 and "state: stopped" in out.stdout
    gone = llmops("status", "--engine-url", "http://127.0.0.1:9")
    assert gone.returncode == 1 and "cannot reach the engine" in gone.stderr


def test_help_documents_every_field() -> None:
    out = llmops("settings", "set", "--help").stdout
    for field in ("gpu_memory_utilization", "max_model_len", "max_num_seqs", "cpu_kv_cache_gib", "extra_args"):
        assert field in out
    assert "0.80-0.85 is the safe production range" in out


def test_without_a_token_the_cli_is_refused_clearly(idle_engine: EngineHandle) -> None:
    out = llmops("status", "--port", str(idle_engine.port), "--data-dir", str(idle_engine.data_dir / "elsewhere"))
    assert out.returncode == 1 and "401" in out.stderr and "token" in out.stderr


def test_token_create_list_revoke(idle_engine: EngineHandle) -> None:
    viewer = llmops("token", "create", "--role", "viewer", "--name", "oncall", "--data-dir",
                    str(idle_engine.data_dir)).stdout.strip()
    assert viewer.startswith("llmops_")
    assert llmops("status", "--port", str(idle_engine.port), token=viewer).returncode == 0
    refused = llmops("settings", "set", "max_num_seqs=2", "--port", str(idle_engine.port), token=viewer)
    assert refused.returncode == 1 and "403" in refused.stderr and "needs operator" in refused.stderr
    listing = llmops("token", "list", "--data-dir", str(idle_engine.data_dir)).stdout
    assert "oncall" in listing and viewer not in listing  # tokens are never shown again
    assert llmops("token", "revoke", "oncall", "--data-dir", str(idle_engine.data_dir)).returncode == 0
    assert "401" in llmops("status", "--port", str(idle_engine.port), token=viewer).stderr


def test_console_command_runs_the_console_behind_the_edge() -> None:
    """`llmops console` once pointed at engine/console/server.py after the CLI moved into engine/cli/; then ran
    `streamlit run`, whose server read request heads of any size (issue 17): it runs console/serve.py now, found
    where the CLI found it."""
    import importlib.util

    from engine.cli.processes import _console_command

    secrets_held = {"LLMOPS_ADMIN_PASSWORD": "pw-1234567890", "LLMOPS_HF_TOKEN": "hf_x", "AWS_SECRET_ACCESS_KEY": "a",
                    "LLMOPS_DATABASE_URL": "postgresql://u:p@db/x", "PGPASSWORD": "p"}
    os.environ.update(secrets_held)
    try:
        cmd, env = _console_command(8501, "http://127.0.0.1:8000")
    finally:
        for name in secrets_held:
            os.environ.pop(name, None)
    # an allow-list, as for vLLM: the console got the whole environment, the engine's secrets with it (issue 31)
    assert set(env) & set(secrets_held) == set() and "PATH" in env
    assert cmd[1:3] == ["-m", "console.serve"] and cmd[cmd.index("--port") + 1] == "8501"
    spec = importlib.util.find_spec("console.serve")
    assert spec is not None and spec.origin is not None
    assert str(Path(spec.origin).resolve().parent.parent) in env["PYTHONPATH"].split(os.pathsep)
    assert env["LLMOPS_ENGINE_URL"] == "http://127.0.0.1:8000"


def test_a_database_url_that_cannot_be_read_is_said_without_a_traceback(tmp_path: Path) -> None:
    """A port that is not a number printed a raw traceback (issue 31)."""
    for url in ("postgresql://u:secret-pw@127.0.0.1:abc/x", "postgresql://u:secret-pw@127.0.0.1:99999/x"):
        done = subprocess.run([sys.executable, "-m", "engine.cli", "db", "current", "--data-dir", str(tmp_path)],
                              env={**os.environ, "LLMOPS_DATABASE_URL": url}, cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        said = done.stdout + done.stderr
        assert done.returncode == 1 and "Traceback" not in said, said[-1500:]
        assert "LLMOPS_DATABASE_URL" in said or "postgresql://USER" in said, said
        assert "secret-pw" not in said
