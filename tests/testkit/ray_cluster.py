"""A real Ray cluster on this host: a head and a second node (``ray.cluster_utils.Cluster``: each node its own
raylet, as ``ray start`` would make them), for the fleet tests. A node can be removed as a machine would be lost.
It asks for a token, as docs/fleet.md says a fleet must (the engine refuses one that does not): RAY_AUTH_MODE=token
and a fresh RAY_AUTH_TOKEN in this process's environment while it runs, which the engines started meanwhile
inherit. ``open_ray_head`` starts one that asks for nothing, to prove the refusal."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.vllm import free_port
from tests.testkit.environ import environ

OBJECT_STORE = 80 << 20  # the tests move no objects through it; Ray's default would take a third of the RAM


@contextmanager
def ray_cluster(nodes: int = 2, cpus: int = 2) -> Iterator[Any]:
    """``Cluster`` with ``nodes`` nodes (the first the head); shut down, every node, whatever happens."""
    from ray.cluster_utils import Cluster

    with ray_token_auth(), _cluster(Cluster, nodes, cpus) as cluster:
        yield cluster


@contextmanager
def ray_token_auth() -> Iterator[None]:
    """RAY_AUTH_MODE=token and a fresh RAY_AUTH_TOKEN in this process's environment for the block (the clusters and
    engines started in it inherit them; this process's own Ray config reads them again)."""
    try:
        with environ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}):
            _reload_ray_config()
            yield
    finally:
        _reload_ray_config()  # the variables put back, read again


def _reload_ray_config() -> None:
    """Ray reads RAY_AUTH_MODE into a process-wide config: read it again (this process talks to the cluster too)."""
    from ray._raylet import Config  # type: ignore[attr-defined]

    Config.initialize("")


@contextmanager
def _cluster(make: Any, nodes: int, cpus: int) -> Iterator[Any]:
    cluster = make(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False,
                                                            "object_store_memory": OBJECT_STORE})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus, object_store_memory=OBJECT_STORE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@contextmanager
def open_ray_head() -> Iterator[str]:
    """A one-node Ray head that asks for no token (``ray start --head``, RAY_AUTH_MODE=disabled), its own port and
    temp dir; its address; stopped (that head's processes only) at the end."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"RAY_AUTH_MODE": "disabled"}
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    temp = Path(tempfile.mkdtemp(prefix="ray-open-", dir="/tmp"))  # short: Ray's socket paths fit in 107 bytes
    started = subprocess.run([*ray, "start", "--head", "--port", str(port), "--num-cpus", "1", "--include-dashboard",
                              "false", "--disable-usage-stats", "--object-store-memory", str(OBJECT_STORE),
                              "--temp-dir", str(temp)], env=env, capture_output=True, text=True, timeout=120,
                             check=False)
    assert started.returncode == 0, f"ray start --head failed:\n{(started.stdout + started.stderr)[-3000:]}"
    try:
        yield f"127.0.0.1:{port}"
    finally:
        # `ray stop` stops every Ray process of this user (the fleet's cluster too): kill this head's own instead
        pids = subprocess.run(["pgrep", "-f", str(temp)], capture_output=True, text=True, check=False).stdout
        for pid in pids.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        shutil.rmtree(temp, ignore_errors=True)
