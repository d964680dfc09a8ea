"""Issue 33 (found in review): an autoscaled deployment's replicas each get their own GPUs when the host has enough
for max_replicas, and the room a new replica needs is looked for on its own GPUs — not on GPU 0, which the first
replica fills (that kept every added replica waiting for memory for ever)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine.capacity import Planner
from engine.revisions import EngineSettings

GIB = 1 << 30


def gpu(index: int, used_gib: float) -> Any:
    return SimpleNamespace(index=index, lost=False, values={"mem_total": 80 * GIB, "mem_used": used_gib * GIB})


def test_the_room_of_replica_n_is_its_own_gpu(tmp_path: Path) -> None:
    planner = Planner("cuda", tmp_path, SimpleNamespace(latest=None), SimpleNamespace())  # type: ignore[arg-type]
    snap = SimpleNamespace(gpus=[gpu(0, 70), gpu(1, 1)], host={})  # replica 0 fills GPU 0; GPU 1 is free
    autoscaled = EngineSettings.model_construct(model="m", gpu_memory_utilization=0.85, replicas=1, max_replicas=2,
                                                tensor_parallel_size=1)
    assert autoscaled.most_replicas == 2
    assert planner.room_for(autoscaled, snap, index=1) is None
    short = planner.room_for(autoscaled, snap, index=0)
    assert short is not None and "GPU 0" in short
    shared = EngineSettings.model_construct(model="m", gpu_memory_utilization=0.85, replicas=1,
                                            tensor_parallel_size=1)  # one replica at most: GPU 0 is where it goes
    assert planner.room_for(shared, snap, index=1) is not None
