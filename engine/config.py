"""The engine's process configuration: one pydantic-settings class, read from ``LLMOPS_*`` and the CLI.

These are the knobs of the engine process itself (where it listens, where its data lives, how patient it is).
The knobs of vLLM are settings revisions (``engine/revisions/settings.py``), versioned in SQLite.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class AppConfig(BaseSettings):
    """Configuration of the engine, the console and the CLI. Every field can be set as LLMOPS_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="LLMOPS_", extra="ignore")

    data_dir: Path = Field(Path("data"), description="Folder for the SQLite database, logs and the demo model.")
    host: str = Field("127.0.0.1", description="Address the engine's HTTP service listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the engine's HTTP service (/v1, /api).")
    console_port: int = Field(8501, ge=1, le=65535, description="Port of the Streamlit console.")
    console_host: str = Field("127.0.0.1", description="Address the console listens on (0.0.0.0: every interface).")
    public_url: str | None = Field(None, description="The engine's address as clients reach it (its /v1 base URL "
                                   "on the console's Overview); default http://HOST:PORT.")
    access_log: bool = Field(False, description="One log line per HTTP request (uvicorn's access log). Off by "
                             "default: /v1 traffic would bury everything else the engine says.")
    engine_url: str = Field("http://127.0.0.1:8000", description="Where the console and the CLI reach the engine.")
    vllm_python: str = Field(sys.executable, description="Python interpreter that runs vLLM's API server.")
    autostart: bool = Field(True, description="Start vLLM with the desired revision when the engine starts.")
    startup_timeout_s: float = Field(900.0, gt=0, description="Longest wait for a vLLM start to become ready.")
    stop_timeout_s: float = Field(20.0, gt=0, description="Wait after SIGTERM before the child's group is SIGKILLed.")
    health_interval_s: float = Field(5.0, gt=0, description="Period of the /health probe while vLLM is ready.")
    reconcile_interval_s: float = Field(0.5, gt=0, le=1.0,
                                        description="Period of the desired-vs-running revision check.")
    backoff_initial_s: float = Field(2.0, gt=0, description="First wait before restarting a failed vLLM child.")
    backoff_max_s: float = Field(60.0, gt=0, description="Cap of the exponential restart backoff.")
    crashloop_max_failures: int = Field(3, ge=1, description="Crashes within crashloop_window_s that halt restarts.")
    crashloop_window_s: float = Field(600.0, gt=0, description="Window of the crash-loop guard.")
    drain_timeout_s: float = Field(60.0, ge=0, description="How long in-flight /v1 requests may finish on apply.")
    engine_nice: int = Field(-10, ge=-20, le=19, description="The engine's CPU priority (nice value), asked for at "
                             "start: its gateway is on the path of every token, and where vLLM keeps every core busy "
                             "(the CPU build) a gateway that waits for a core delays each one (on 2 cores: 0.56 of "
                             "direct throughput at 0, 0.86 at -10). Below 0 needs root or CAP_SYS_NICE; refused, the "
                             "engine says so and runs at its own. vLLM, benchmarks and the demo model's training "
                             "run at vllm_nice.")
    vllm_nice: int = Field(0, ge=-20, le=19, description="CPU priority (nice value) of the processes the engine "
                           "starts: vLLM, its benchmarks, the demo model's training.")
    handover_s: float = Field(10.0, ge=0, description="After a new instance takes traffic, how long the instance it "
                              "replaces may keep serving beside it until the new one has ended its first requests "
                              "(a cold instance's first batch is its slowest); then the old one drains.")
    sleep_mode: bool = Field(True, description="On CUDA: start vLLM with sleep mode, and when an apply must pause "
                             "(nothing fits beside the old instance) put the old one to sleep instead of stopping it, "
                             "so a new revision that fails is rolled back in about a second, not a restart.")
    queue_size: int = Field(256, ge=0, description="Requests held while vLLM restarts; past it: 503.")
    queue_timeout_s: float = Field(300.0, ge=0, description="Longest a held request waits for vLLM; then 503.")
    upstream_timeout_s: float = Field(600.0, gt=0, description="Longest a /v1 request may take inside vLLM.")
    serving_scrape_interval_s: float = Field(5.0, gt=0, description="Period of the scrape of vLLM's /metrics.")
    ledger_sample_rate: float = Field(0.0, ge=0, le=1, description="Share of /v1 requests whose prompt text the "
                                      "request ledger keeps (0: none; tokens and timings are always kept).")
    gpu_sample_interval_s: float = Field(1.0, ge=0.1, le=60, description="Period of the NVML/host sampler.")
    telemetry_raw_retention_s: float = Field(3600.0, ge=60, description="How long raw telemetry samples are kept.")
    telemetry_minute_retention_s: float = Field(7 * 86400.0, ge=3600,
                                                description="How long per-minute telemetry roll-ups are kept.")
    alert_memory_pct: float = Field(95.0, gt=0, le=100, description="GPU memory use (% of total) that raises an alert.")
    alert_temperature_c: float = Field(85.0, gt=0, description="GPU temperature that raises an alert.")
    alert_power_hold_s: float = Field(30.0, ge=0, description="Seconds at the power limit before an alert.")
    alert_quiet_s: float = Field(600.0, ge=0, description="Quiet time after which an XID/ECC alert clears.")
    admin_password: SecretStr | None = Field(None, description="Password of the first console user, admin (else "
                                             "one is generated and printed once).")
    session_ttl_s: float = Field(12 * 3600, gt=0, description="How long a console sign-in lasts.")
    login_max_failures: int = Field(5, ge=1, description="Failed sign-ins in a row that lock a user out.")
    login_lockout_s: float = Field(900, ge=0, description="How long a locked-out user waits.")
    gateway_keys: Literal["auto", "on", "off"] = Field(
        "auto", description="Require API keys on /v1: auto = only when listening beyond loopback.")
    hf_token: SecretStr | None = Field(None, description="Hugging Face token for gated models; given to vLLM "
                                       "through its environment, never its arguments, logs or events.")
    model_roots: list[Path] = Field(default_factory=list, description="Folders local models may come from, "
                                    "besides DATA_DIR/models and the Hugging Face cache.")
    body_limit_auth_bytes: int = Field(16 * 1024, ge=1024, description="Largest request body of the sign-in routes "
                                       "(/api/auth/*), which anyone may call; past it: 413.")
    body_limit_api_bytes: int = Field(1 << 20, ge=4096, description="Largest request body of the other /api routes "
                                      "(settings, prompts, users, tokens, benchmarks); past it: 413.")
    body_limit_v1_bytes: int = Field(32 << 20, ge=4096, description="Largest request body of a /v1 request "
                                     "(long prompts, images as base64); past it: 413.")
    json_max_depth: int = Field(64, ge=8, le=500, description="Deepest nesting of arrays and objects a JSON body "
                                "may have; deeper: 400.")
    body_timeout_s: float = Field(60.0, gt=0, description="Longest a request's body may take to arrive once its "
                                  "headers have; past it: 408 (a client trickling a body holds no worker).")
    header_timeout_s: float = Field(10.0, gt=0, description="Longest a request's headers may take to arrive; past "
                                    "it the connection is closed (slowloris).")
    min_free_disk_bytes: int = Field(64 << 20, ge=0, description="Free space the data dir's disk must have for a "
                                     "change to be accepted; below it changes are refused with 507, nothing done.")
    log_max_bytes: int = Field(10_000_000, gt=0, description="Size at which vLLM's log file rotates.")
    log_backups: int = Field(5, ge=0, description="Rotated vLLM log files kept.")
    prompt_max_chars: int = Field(32_000, ge=1000, description="Largest saved playground prompt: its system "
                                  "prompt, prompt and JSON schema together, in characters; larger: 422.")
    prompts_per_user: int = Field(100, ge=1, description="Saved playground prompts one user may keep; past it a "
                                  "save gets 409 until they delete one.")

    @property
    def db_path(self) -> Path:
        return self.data_dir / "llmops.db"

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def demo_model_dir(self) -> Path:
        return self.data_dir / "models" / "demo"
