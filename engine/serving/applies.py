"""How an apply replaces what serves (engine/capacity/plans.py chooses which, engine/serving/supervisor.py runs
it): each strategy a function of the supervisor, apart from its reconcile loop.

- **blue/green**: the new instance starts beside the old one; the gateway moves to it; the old one drains.
- **bridge**: a small instance of the old revision starts beside the old one and takes the traffic; the old one
  drains and stops; the new one starts beside the bridge and takes the traffic; the bridge drains and stops.
- **rolling** (2 or more replicas): one replica at a time drains, stops and comes back on the new revision, on its
  node, so capacity never falls below (N-1)/N; the next one drains once the new one has ended its first requests.
- **pause**: drain, stop (on CUDA with sleep mode: put to sleep), start, serve the queue.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httpx

from engine.db import Revision
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut, EngineState
from engine.serving.readiness import probe

if TYPE_CHECKING:
    from engine.serving.supervisor import Instance, Supervisor

S = EngineState


async def blue_green(sup: Supervisor, desired: Revision, settings: EngineSettings) -> None:
    olds = [i for i in sup.instances if i.serving]
    sup._step(f"starting revision {desired.id} beside the instance that serves")
    new = await sup._launch(desired, settings, name=sup._free_name(), device=sup._device_for(0, settings),
                            node=olds[0].child.node if olds else None)
    outcome = await sup._await_ready(new)
    if not outcome.ready:
        await sup._new_failed(new, outcome)
        return
    await sup._handover(new, await sup._promote(new))
    for old in olds:
        sup._step(f"draining instance {old.name}")
        await sup._retire(old, f"revision {desired.id} serves on instance {new.name}")
    sup._done("applied")


async def bridge(sup: Supervisor, desired: Revision, settings: EngineSettings, plan: ApplyPlanOut) -> None:
    olds = [i for i in sup.instances if i.serving]
    old = next((i for i in olds if not i.bridge), olds[0])
    assert plan.bridge is not None
    small = old.settings.model_copy(update={"gpu_memory_utilization": plan.bridge.gpu_memory_utilization,
                                            "max_num_seqs": plan.bridge.max_num_seqs, "replicas": 1})
    sup._step(f"starting a bridge at {plan.bridge.gpu_memory_utilization:.2f} beside instance {old.name}")
    bridge = await sup._launch(old.revision, small, name=sup._free_name(), device=old.device, bridge=True,
                               node=old.child.node)
    outcome = await sup._await_ready(bridge)
    if not outcome.ready:
        await sup._stop(bridge, outcome.reason)
        await sup._event("bridge_failed", f"the bridge did not start ({outcome.reason}): pausing instead",
                          "warning", desired.id, data={"last_lines": list(bridge.child.lines)[-30:]})
        if not outcome.aborted:
            await pause(sup, desired, settings)
        return
    await sup._handover(bridge, await sup._promote(bridge))
    for inst in olds:
        sup._step(f"the bridge serves; draining instance {inst.name}")
        await sup._retire(inst, "the bridge serves")
    sup._step(f"starting revision {desired.id} beside the bridge")
    new = await sup._launch(desired, settings, name=sup._free_name(), device=old.device, node=old.child.node)
    outcome = await sup._await_ready(new)
    if not outcome.ready:
        await sup._stop(new, outcome.reason)
        if outcome.aborted:  # a newer revision: the next tick applies it, from the bridge
            return
        # The bridge serves; the apply ends when the old revision serves at its full size again.
        sup._step(f"revision {desired.id} failed; bringing revision {old.revision.id} back beside the bridge")
        back = await sup._launch(old.revision, old.settings, name=sup._free_name(), device=old.device,
                                 node=old.child.node)
        if (await sup._await_ready(back, abort_on_new_desired=False)).ready:
            await sup._promote(back)
            sup._step("draining the bridge")
            await sup._retire(bridge, f"revision {old.revision.id} serves again")
        else:
            await sup._stop(back, "the old revision did not start again: the bridge keeps serving")
        await sup._reject(new, outcome)
        return
    await sup._handover(new, await sup._promote(new))
    sup._step("draining the bridge")
    await sup._retire(bridge, f"revision {desired.id} serves")
    sup._done("applied")


async def rolling(sup: Supervisor, desired: Revision, settings: EngineSettings) -> None:
    olds = [i for i in sup.instances if i.serving]
    for index, old in enumerate(olds):
        sup._step(f"replica {index + 1} of {len(olds)}: draining instance {old.name}")
        device = old.device
        await sup._retire(old, f"rolling to revision {desired.id}")
        sup._step(f"replica {index + 1} of {len(olds)}: starting revision {desired.id}")
        new = await sup._launch(desired, settings, name=sup._free_name(), device=device, node=old.child.node,
                                index=index)
        outcome = await sup._await_ready(new)
        if not outcome.ready:
            await sup._new_failed(new, outcome)
            if not outcome.aborted:  # the replica it replaced comes back on the old revision
                back = await sup._launch(old.revision, old.settings, name=sup._free_name(), device=device,
                                         node=old.child.node, index=index)
                if (await sup._await_ready(back, abort_on_new_desired=False)).ready:
                    await sup._promote(back)
                else:
                    await sup._stop(back, "could not bring the replica back")
            return
        upstream = await sup._promote(new)
        if index + 1 < len(olds):  # a cold instance's first batch is its slowest: the next one drains after it
            await sup._handover(new, upstream)
    sup._done("applied")


async def pause(sup: Supervisor, desired: Revision, settings: EngineSettings) -> None:
    """Nothing fits beside what serves: drain it and stop it (on CUDA with sleep mode: put it to sleep, so a
    revision that fails is rolled back in about a second), then start the new revision."""
    olds = [i for i in sup.instances if i.serving]
    sleepers: list[Instance] = []
    for inst in olds:
        await sup._close(inst)
    sup._step(f"draining for revision {desired.id}")
    if sup.sm.state == S.READY:
        await sup._enter(S.DRAINING, f"applying revision {desired.id}")
    t0, in_flight = time.monotonic(), sup.admission.in_flight
    left = await sup.admission.drain(sup.config.drain_timeout_s)
    sup._timed("drain", ",".join(i.name for i in olds), time.monotonic() - t0, in_flight)
    await sup._event("drained", f"{left} requests still in flight after {sup.config.drain_timeout_s:.0f} s"
                      if left else f"drained in-flight requests: applying revision {desired.id}",
                      "warning" if left else "info", olds[0].revision.id if olds else None)
    await sup._enter(S.STOPPING, f"applying revision {desired.id}")
    for inst in olds:
        if sup.build == "cuda" and sup.config.sleep_mode and not inst.bridge and await sleep(sup, inst):
            sleepers.append(inst)
        else:
            await sup._stop(inst, f"applying revision {desired.id}")
    for inst in [i for i in sup.instances if i not in sleepers]:
        await sup._stop(inst, f"applying revision {desired.id}")
    await sup._enter(S.STOPPED, f"applying revision {desired.id}")
    await sup._enter(S.STARTING, f"starting revision {desired.id}")
    sup._step(f"starting revision {desired.id}")
    new = await sup._launch(desired, settings, name=sup._free_name(), device=sup._device_for(0, settings),
                            node=olds[0].child.node if olds else None)
    outcome = await sup._await_ready(new)
    if outcome.ready:
        await sup._promote(new)
        for inst in sleepers:
            await sup._stop(inst, f"revision {desired.id} serves")
        sup._done("applied")
        return
    if sleepers:
        await sup._stop(new, outcome.reason)
        for inst in sleepers:  # first serve again (the gap closes), then diagnose
            await wake_up(sup, inst)
        if not outcome.aborted:
            await sup._reject(new, outcome)
        return
    if outcome.aborted:
        await sup._stop(new, outcome.reason)
        return
    await sup._start_failed(new, outcome)


# --- sleep mode (CUDA) -------------------------------------------------------------------------------------------


async def sleep(sup: Supervisor, inst: Instance) -> bool:
    """Put an instance to sleep (level 1: weights to CPU memory, KV cache dropped); False if it would not."""
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(base_url=inst.child.url, timeout=120) as client:
            resp = await client.post("/sleep", params={"level": 1})
    except httpx.HTTPError as exc:
        await sup._event("sleep_failed", f"instance {inst.name} could not sleep ({exc}): stopping it", "warning")
        return False
    if resp.status_code != 200:
        await sup._event("sleep_failed", f"instance {inst.name} could not sleep (HTTP {resp.status_code}): "
                          "stopping it", "warning")
        return False
    inst.role = "sleeping"
    sup._timed("sleep", inst.name, time.monotonic() - t0, 0)
    await sup._event("sleeping", f"instance {inst.name} asleep after {time.monotonic() - t0:.1f} s (revision "
                      f"{inst.revision.id} can serve again in about a second)", revision_id=inst.revision.id,
                      data={"sleep_s": round(time.monotonic() - t0, 2), "instance": inst.name})
    return True


async def wake_up(sup: Supervisor, inst: Instance) -> None:
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(base_url=inst.child.url, timeout=120, headers=inst.child.headers) as client:
            ok = (await client.post("/wake_up")).status_code == 200 and await probe(
                client, inst.settings.served_model_name)
    except httpx.HTTPError:
        ok = False
    if not ok:
        await sup._stop(inst, "it did not wake up")
        return
    seconds = time.monotonic() - t0
    inst.role = "starting"
    await sup._promote(inst, woken=True)
    await sup._event("woken", f"instance {inst.name} serves revision {inst.revision.id} again "
                      f"{seconds:.2f} s after wake-up", revision_id=inst.revision.id,
                      data={"wake_s": round(seconds, 2), "instance": inst.name})
