"""A real Ray cluster on this host: a head and a second node (``ray.cluster_utils.Cluster``: each node its own
raylet, as ``ray start`` would make them), for the fleet tests. A node can be removed as a machine would be lost."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

OBJECT_STORE = 80 << 20  # the tests move no objects through it; Ray's default would take a third of the RAM


@contextmanager
def ray_cluster(nodes: int = 2, cpus: int = 2) -> Iterator[Any]:
    """``Cluster`` with ``nodes`` nodes (the first the head); shut down, every node, whatever happens."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False,
                                                            "object_store_memory": OBJECT_STORE})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus, object_store_memory=OBJECT_STORE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
