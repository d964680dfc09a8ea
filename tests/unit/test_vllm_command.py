from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.revisions import EngineSettings, initial_settings, merge_values, validate_settings
from engine.vllm import build_command, build_env
from engine.vllm.command import renice_group, session_nice, unbound_omp_threads
from engine.vllm_guard import KeyOnEveryPath
from tests.testkit.wait import wait_until


def settings(data_dir: Path, **changes: object) -> EngineSettings:
    base = EngineSettings.model_construct(**initial_settings(data_dir)).model_dump()
    return validate_settings(merge_values(base, changes), data_dir)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_cpu_command_sizes_the_kv_cache_explicitly(data_dir: Path) -> None:
    args = build_command(settings(data_dir, cpu_kv_cache_gib=0.25, max_num_seqs=3), python="/py", port=4321,
                         data_dir=data_dir, build="cpu")
    assert args[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(args, "--port") == "4321" and flag(args, "--host") == "127.0.0.1"
    assert flag(args, "--kv-cache-memory-bytes") == str(256 * 1024 * 1024)
    assert flag(args, "--max-num-seqs") == "3"
    assert flag(args, "--model") == str((data_dir / "models" / "demo").resolve())
    assert "--gpu-memory-utilization" not in args
    # every path of the server asks for its key (vLLM's own --api-key guards /v1 only): the guard is importable
    module, _, name = (flag(args, "--middleware") or "").rpartition(".")
    assert getattr(importlib.import_module(module), name) is KeyOnEveryPath


def test_cuda_command_passes_utilization_and_flags(data_dir: Path) -> None:
    s = settings(data_dir, gpu_memory_utilization=0.8, enforce_eager=True, trust_remote_code=True,
                 max_num_batched_tokens=4096, enable_prefix_caching=False, extra_args=["--seed=3"],
                 model="org/model")
    args = build_command(s, python="/py", port=1, data_dir=data_dir, build="cuda")
    assert flag(args, "--gpu-memory-utilization") == "0.8"
    assert flag(args, "--model") == "org/model"
    assert "--enforce-eager" in args and "--trust-remote-code" in args
    assert "--no-enable-prefix-caching" in args
    assert flag(args, "--max-num-batched-tokens") == "4096"
    assert args[-1] == "--seed=3"
    assert "--kv-cache-memory-bytes" not in args


def test_every_argument_is_its_own_list_item(data_dir: Path) -> None:
    s = settings(data_dir, served_model_name="my model".replace(" ", "-"))
    args = build_command(s, python="/py", port=1, data_dir=data_dir, build="cpu")
    assert all(isinstance(a, str) and "\n" not in a for a in args)
    assert flag(args, "--served-model-name") == "my-model"


def test_env_turns_off_usage_reporting_and_legacy_kv_override() -> None:
    env = build_env({"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "40"}, offline=True)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"


def test_unpinned_workers_get_the_threads_pinning_would_give_them() -> None:
    cores = len(os.sched_getaffinity(0))
    assert unbound_omp_threads(1) == max(1, cores - 1)  # a core left for the server and the engine core
    assert unbound_omp_threads(cores + 1) == 1


def test_renice_group_reaches_every_thread_of_every_process_of_the_group() -> None:
    """How a drained vLLM instance stops at the lowest priority: its server, engine core and workers, and each of
    their threads (Linux keeps a nice value per thread)."""
    code = ("import subprocess, sys, threading, time; "
            "[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(2)]; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)

    def threads() -> list[int]:
        tids = []
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                if os.getpgid(int(pid)) == proc.pid:
                    tids += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
        return tids

    try:
        wait_until(lambda: len(threads()) >= 4, 30, every=0.05, what="a group of two processes, four threads")
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        low = min(19, mine + 7)
        assert renice_group(proc.pid, low) is None  # raising a nice value needs no privilege
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in threads()} == {low}
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert renice_group(proc.pid, low) is None  # a group that is gone: nothing to do, no error


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel groups no sessions (autogroup off)")
def test_the_nice_of_a_session_of_its_own_is_the_weight_it_competes_with() -> None:
    """With autogroup, a nice value weighs only within its session, and the engine and each vLLM instance lead
    sessions of their own: the session's weight is set apart (session_nice), or the engine's gateway at -10 weighs
    no more than a vLLM instance (on 2 cores a thread at nice -10 woke up to 1.6 s late). renice_group leaves the
    session's weight alone: a session lowered beside a busy one got no CPU at all."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)

    def weight() -> str:
        return Path(f"/proc/{proc.pid}/autogroup").read_text().split()[-1]

    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        low = min(19, mine + 9)
        assert session_nice(proc.pid, low) is None
        assert weight() == str(low)
        assert session_nice(proc.pid, min(19, mine + 3)) is None
        assert weight() == str(min(19, mine + 3))
        assert renice_group(proc.pid, low) is None
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == low
        assert weight() == str(min(19, mine + 3))  # the session's weight is left as it was
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert session_nice(proc.pid, 5) is None  # a process gone is no error
