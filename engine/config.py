"""The engine's process configuration: one pydantic-settings class, read from ``LLMOPS_*`` and the CLI.

These are the knobs of the engine process itself (where it listens, where its data lives, how patient it is).
The knobs of vLLM are settings revisions (``engine/revisions/settings.py``), versioned in SQLite.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class AppConfig(BaseSettings):
    """Configuration of the engine, the console and the CLI. Every field can be set as LLMOPS_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="LLMOPS_", extra="ignore")

    data_dir: Path = Field(Path("data"), description="Folder for the SQLite database, logs and the demo model.")
    database_url: SecretStr | None = Field(None, description="Where the engine keeps its state (revisions, events, "
                                           "audit, users, tokens, prompts, benchmarks, ledger, history): a "
                                           "PostgreSQL URL, postgresql://USER:PASSWORD@HOST:PORT/DBNAME (psycopg 3), "
                                           "so that a control plane keeps it off the GPU host; or sqlite:///PATH. "
                                           "Default: the SQLite file DATA_DIR/llmops.db. Its password is never "
                                           "logged; the schema is migrated at start (`llmops db upgrade`).")
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
    vllm_sandbox: bool = Field(True, description="Start every vLLM server in a filesystem sandbox (Linux Landlock, "
                               "engine/vllm_sandbox.py): vLLM runs a model's code as the engine's user, and cannot "
                               "open the engine's data dir (the database, run/cli.token, run/console.key, the logs) "
                               "but for models/ and the caches its environment puts there, nor the console's key "
                               "or a SQLite database elsewhere; the engine's code and Python it can only read. "
                               "Where the kernel has no Landlock, vLLM starts unconfined and the engine says so in "
                               "its log and events; off: the same, on purpose (docs/fleet.md, What vLLM can read).")
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
                             "engine says so and runs at its own. Where the kernel weighs sessions against each "
                             "other (autogroup) it is also the weight of the engine's session, when the engine leads "
                             "one (llmops up starts it so). vLLM, benchmarks and the demo model's training run at "
                             "vllm_nice.")
    vllm_nice: int = Field(0, ge=-20, le=19, description="CPU priority (nice value) of the processes the engine "
                           "starts: vLLM, its benchmarks, the demo model's training.")
    start_beside_nice: int = Field(19, ge=-20, le=19, description="CPU build: the nice value of a vLLM instance "
                                   "started while another serves, until it serves itself (then vllm_nice). On a "
                                   "small host its start (the compile above all) took the cores from the instance "
                                   "that serves, and clients saw seconds with no answer; at 19 the start gets what "
                                   "serving leaves and takes longer. Where the kernel weighs sessions (autogroup) "
                                   "it weighs only inside the instance's own session, which keeps the kernel's "
                                   "default weight (a lower one starved the start). vllm_nice or lower: no difference "
                                   "made.")
    handover_s: float = Field(10.0, ge=0, description="After a new instance takes traffic, how long the instance it "
                              "replaces may keep serving beside it until the new one has ended its first requests "
                              "(a cold instance's first batch is its slowest); then the old one drains.")
    sleep_mode: bool = Field(True, description="On CUDA: start vLLM with sleep mode, and when an apply must pause "
                             "(nothing fits beside the old instance) put the old one to sleep instead of stopping it, "
                             "so a new revision that fails is rolled back in about a second, not a restart.")
    queue_size: int = Field(256, ge=0, description="Requests held while vLLM restarts; past it: 503.")
    queue_timeout_s: float = Field(300.0, ge=0, description="Longest a held request waits for vLLM; then 503.")
    upstream_timeout_s: float = Field(600.0, gt=0, description="Longest a /v1 request may take inside vLLM.")
    gateway_workers: int | None = Field(None, ge=0, le=64, description="Worker processes that serve the /v1 data "
                                        "path on gateway_port besides the engine's own port, each relaying tokens "
                                        "on a core of its own while the engine keeps what they share (each "
                                        "instance's cap and requests in flight, routing, keys and their limits, the "
                                        "ledger); one that dies is started again and the others' requests go on "
                                        "(engine/gateway/workers.py). One process relays about 27,000 tokens/s. "
                                        "Empty: by the cores this process may use, a quarter of them, at most 8, "
                                        "none below 4 cores; 0: none (the data port is not opened).")
    gateway_worker_busy_share: float = Field(0.0, ge=0, le=1, description="New connections on the data port go "
                                             "to as few gateway workers as their load needs: the next worker "
                                             "takes them only once the first ones are this busy (a share of a "
                                             "core each), and a worker clearly busier than the others lets some "
                                             "of its connections go after their response, so that their clients "
                                             "reconnect to one with room (engine/gateway/steering.py). 0 (the "
                                             "default): every worker takes new connections, spread by the kernel. "
                                             "0.5 cut the workers' CPU per token by a third on a 2-core host (64 "
                                             "paced streams); on a 16-core H100 host it saved nothing and its "
                                             "gateway/direct throughput was 0.94-0.95 against 1.01 spread "
                                             "(docs/routing.md), so it is off until measured otherwise.")
    gateway_port: int | None = Field(None, ge=0, le=65535, description="Port of the gateway workers' /v1 data "
                                     "path, on the engine's host; empty: port + 1. Only /v1 (and /tokenize, "
                                     "/detokenize) is served there; the engine's API stays on port.")
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
    login_hash_workers: int = Field(2, ge=1, le=64, description="Password hashes (argon2: 64 MiB and up to 4 "
                                    "threads each) computed at once, on threads of their own at a lower CPU priority "
                                    "than the event loop: sign-ins never take the threads that serve /healthz, "
                                    "/readyz and the API.")
    login_hash_queue: int = Field(16, ge=0, le=10_000, description="Sign-ins that may wait for a hashing thread; "
                                  "past it a sign-in is refused with 429 and Retry-After (a flood of sign-ins costs "
                                  "at most login_hash_workers hashes of memory).")
    login_hash_per_source: int = Field(4, ge=1, le=10_000, description="Of the sign-ins running or waiting for a "
                                       "hashing thread, the most that one source (the browser's address, else the "
                                       "peer's) may hold; past it that source gets 429 and Retry-After while others "
                                       "still sign in (an anonymous flood from one address kept 13 of 15 real "
                                       "sign-ins out).")
    gateway_keys: Literal["auto", "on", "off"] = Field(
        "auto", description="Require API keys on /v1: auto = only when listening beyond loopback.")
    limit_bytes_per_token: float = Field(1.0, ge=0.5, le=16, description="A key's or team's token limits reserve a "
                                         "request's prompt at admission as its body's bytes divided by this, then "
                                         "settle what vLLM counted when it ends. 1 never reserves too few for "
                                         "byte-level tokenizers (Llama 3, Qwen, Mistral, GPT-2: a token is at least "
                                         "a byte), so a budget is never overshot; English text is about 4 bytes a "
                                         "token, so 4 lets more requests run at once near a limit, and overshoots "
                                         "by what it under-reserved.")
    limit_unasked_max_tokens: int = Field(1024, ge=1, le=10_000_000, description="Completion tokens reserved for "
                                          "a request that names no max_tokens (vLLM would generate up to the "
                                          "model's length), against its key's or team's token limits.")
    alert_interval_s: float = Field(5.0, ge=0.2, le=300, description="How often alert rules are looked at "
                                    "(engine/notify): an alert fires at most this long after its condition has "
                                    "held for the rule's for_s.")
    limit_cache_s: float = Field(5.0, ge=0, le=3600, description="How long a key's limits and team, read from the "
                                 "database, are believed; an edit through this engine takes effect at once, one "
                                 "by another process (the CLI) within this.")
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
                                    "it the connection is closed (slowloris). Engine and console.")
    header_limit_bytes: int = Field(64 * 1024, ge=4096, le=1 << 20, description="Largest request head (request "
                                    "line and headers) the engine and the console read; past it: 431 and the "
                                    "connection closed, the rest unread (nginx and HAProxy take about as much).")
    header_line_limit_bytes: int = Field(8 * 1024, ge=1024, le=1 << 20, description="Longest line of a request "
                                         "head; past it: 414 for the request line (its URL), 431 for a header "
                                         "line, and the connection closed, the rest unread.")
    allowed_hosts: list[str] = Field(default_factory=list, description="Names (Host headers) the engine and the "
                                     "console answer besides IP addresses, localhost, host, console_host and the "
                                     "hosts of public_url and engine_url; others get 421 (a page on another site "
                                     "whose name resolves here: DNS rebinding). '.example.com' covers its "
                                     "subdomains, '*' any name. As JSON: LLMOPS_ALLOWED_HOSTS='[\"gpu-box\"]'.")
    v1_body_budget_bytes: int = Field(128 << 20, ge=4096, description="Bytes of /v1 request bodies the engine holds "
                                      "at once, all requests together (read, or waiting for vLLM), counted as they "
                                      "arrive, not as declared. A request whose declared length does not fit now is "
                                      "refused with 503 and Retry-After before its body is read, one that grows past "
                                      "it as it arrives; at least body_limit_v1_bytes.")
    v1_body_share_bytes: int | None = Field(None, ge=4096, description="The most of v1_body_budget_bytes one "
                                            "client (its gateway key, else its address) holds at once; past it: 503 "
                                            "and Retry-After, so that no one client can take the whole budget. At "
                                            "least body_limit_v1_bytes; empty: half the budget (at least "
                                            "body_limit_v1_bytes), so that clients behind one proxy whose forwarded "
                                            "addresses are not trusted still send several large bodies at once.")
    v1_max_n: int = Field(16, ge=1, le=1024, description="The most choices (n, best_of) one /v1 request may ask "
                          "for; past it: 400 naming the field (n=1,024 held every other client of the deployment for "
                          "seconds, and the time grows with it).")
    v1_max_prompts: int = Field(2048, ge=1, description="The most prompts one /v1 request may hold (a completion's "
                                "list of prompts, an embedding's list of inputs); past it: 400.")
    v1_max_asked_tokens: int = Field(65_536, ge=1, description="The most tokens one /v1 request may ask vLLM to "
                                     "generate: prompts × choices (n or best_of) × max_tokens (as its route reads "
                                     "it: chat's max_completion_tokens, the Responses API's max_output_tokens); past "
                                     "it: 400 naming the three.")
    body_first_byte_s: float = Field(5.0, gt=0, description="Longest a request body's first byte may take to "
                                     "arrive once the headers have; past it: 408 (a connection that declares a "
                                     "body and sends nothing is let go at once, not after body_timeout_s).")
    min_free_disk_bytes: int = Field(64 << 20, ge=0, description="Free space the data dir's disk must have for a "
                                     "change to be accepted; below it changes are refused with 507, nothing done.")
    ray_address: str | None = Field(None, description="A Ray cluster to place vLLM instances on (the address "
                                    "`ray start --head` printed, e.g. 10.0.0.5:6379, or auto): the engine becomes a "
                                    "Ray driver, each instance an actor pinned to a node, each node's GPUs sampled "
                                    "there. Unset (the default): instances are child processes of the engine and Ray "
                                    "is not imported.")
    ray_allow_unauthenticated: bool = Field(False, description="Place instances on a Ray cluster that answers "
                                            "without Ray's token (RAY_AUTH_MODE=token unset on its nodes). Off: the "
                                            "engine refuses such a cluster at start, since anyone who reaches its "
                                            "ports can run code on its nodes (docs/fleet.md). On: it is used, with a "
                                            "warning in the log and the events.")
    audit_tally_keys_per_minute: int = Field(200, ge=1, le=100_000, description="Refused requests without a "
                                             "valid credential are counted per minute, source, action, target and "
                                             "result (not a row each): the most such keys one minute keeps; the rest "
                                             "are counted under source \"(others)\".")
    audit_tally_max_rows: int = Field(100_000, ge=100, description="Rows of those counts kept in all; past it the "
                                      "oldest minutes are dropped (the audit trail itself is never trimmed).")
    trusted_proxies: list[str] = Field(default_factory=list, description="Addresses or networks (CIDR) of reverse "
                                       "proxies in front of the engine whose X-Forwarded-For and X-Forwarded-Proto "
                                       "it believes. Default none: the audit's source is the connection's peer, "
                                       "which no local user can forge by sending a header.")
    console_key_file: Path | None = Field(None, description="The secret with which the console tells the engine "
                                          "a browser's address, so sign-ins through it are audited with the "
                                          "browser's address, not the console's. Default DATA_DIR/run/console.key, "
                                          "made by the engine (0600); `llmops up` and `llmops console` hand its path "
                                          "to the console (LLMOPS_CONSOLE_KEY_FILE).")
    log_max_bytes: int = Field(10_000_000, gt=0, description="Size at which vLLM's log file rotates.")
    log_backups: int = Field(5, ge=0, description="Rotated vLLM log files kept.")
    prompt_max_chars: int = Field(32_000, ge=1000, description="Largest saved playground prompt: its system "
                                  "prompt, prompt and JSON schema together, in characters; larger: 422.")
    prompts_per_user: int = Field(100, ge=1, description="Saved playground prompts one user may keep; past it a "
                                  "save gets 409 until they delete one.")

    @model_validator(mode="after")
    def _budget_takes_a_body(self) -> AppConfig:
        if self.v1_body_share_bytes is not None and self.v1_body_share_bytes < self.body_limit_v1_bytes:
            raise ValueError(f"v1_body_share_bytes ({self.v1_body_share_bytes:,}) is smaller than "
                             f"body_limit_v1_bytes ({self.body_limit_v1_bytes:,}): a body the limit allows could "
                             "never be read")
        if self.v1_body_budget_bytes < self.body_limit_v1_bytes:
            raise ValueError(f"v1_body_budget_bytes ({self.v1_body_budget_bytes:,}) is smaller than "
                             f"body_limit_v1_bytes ({self.body_limit_v1_bytes:,}): a body the limit allows could "
                             "never be taken; raise the budget or lower the limit")
        return self

    @property
    def v1_body_share(self) -> int:
        """v1_body_share_bytes, or its default: half the budget, at least one largest body."""
        return self.v1_body_share_bytes or max(self.body_limit_v1_bytes, self.v1_body_budget_bytes // 2)

    @property
    def gateway_worker_count(self) -> int:
        """gateway_workers, or its default by the cores this process may use."""
        if self.gateway_workers is not None:
            return self.gateway_workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return 0 if cores < 4 else min(8, cores // 4)

    @property
    def data_port(self) -> int:
        """Where the gateway workers listen (gateway_port, or port + 1)."""
        return self.gateway_port if self.gateway_port is not None else self.port + 1 if self.port < 65535 else 65534

    @property
    def db_path(self) -> Path:
        """The embedded SQLite file (the default database)."""
        return self.data_dir / "llmops.db"

    @property
    def database(self) -> Path | str:
        """What the engine opens (engine.db.open_database): the database_url, else the SQLite file's path."""
        return self.database_url.get_secret_value() if self.database_url else self.db_path

    @property
    def console_key_path(self) -> Path:
        return self.console_key_file or self.data_dir / "run" / "console.key"

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def demo_model_dir(self) -> Path:
        return self.data_dir / "models" / "demo"
