"""LoRA adapters over fake vLLM children (engine/deployments/adapters.py): registered while clients stream, loaded
live on every replica before the name is called, kept by an apply (the new instances start with them), brought back
on an instance that lost one, refused whole when an instance cannot load it, and removed from every one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from engine.adapters import AdapterStore
from engine.deployments.adapters import Adapters
from engine.errors import AdapterInvalidError
from engine.revisions import DeploymentRef, EngineSettings
from tests.testkit.adapters import give_demo_weights, make_adapter
from tests.testkit.fake_vllm import Script
from tests.testkit.serving import Scenario


def served_by(sc: Scenario) -> tuple[Adapters, Any]:
    """The fleet's adapters over the scenario's one deployment (its controller, events and revisions)."""
    runtime = SimpleNamespace(ref=DeploymentRef(), name="demo", controller=sc.controller, events=sc.events,
                              revisions=sc.revisions,
                              writer=SimpleNamespace(validate=lambda v: EngineSettings.model_construct(**v)))
    adapters = Adapters(AdapterStore(sc.db), lambda: [cast(Any, runtime)], sc.config.data_dir.resolve(), None)
    sc.controller.launcher.lora_modules = lambda: adapters.modules(1)
    return adapters, runtime


async def test_an_adapter_registered_under_load_is_served_by_every_replica_and_kept_by_an_apply(
        tmp_path: Path) -> None:
    async with Scenario(tmp_path, values={"replicas": 2, "enable_lora": True, "max_num_seqs": 8}) as sc:
        adapters, runtime = served_by(sc)
        await adapters.start()
        try:
            give_demo_weights(sc.config.data_dir / "models" / "demo")
            make_adapter(sc.config.data_dir / "models" / "tuned")
            await sc.until(sc.serving_revision(1, instances=2))
            async with sc.clients(6) as base:  # the base model streams throughout
                await sc.until(lambda: len(base.results) >= 20)
                row = await adapters.register(runtime, "tuned", "models/tuned", "test")
                assert row.rank == 8 and adapters.owner("tuned") == 1
                assert all(f.loras == {"tuned": str((sc.config.data_dir / "models" / "tuned").resolve())}
                           for f in sc.placement.live())
                async with sc.clients(6, model="tuned") as tuned:
                    await sc.until(lambda: len(tuned.results) >= 40)
                    # an apply (a restart-class change): the new instances start with the adapter, none is lost
                    rev = sc.write({"max_model_len": 1024})
                    await sc.until(sc.serving_revision(rev.id, instances=2))
                    done = len(tuned.results)
                    await sc.until(lambda: len(tuned.results) >= done + 20)
                assert tuned.failed == [] and base.failed == []
            new = sc.placement.live()
            assert all(f.revision_id == rev.id and "tuned" in f.loras and f.served.lora_calls == [] for f in new)
            assert all("tuned" in f.served.models for f in sc.fakes)  # every instance, old and new, served it

            # an instance that lost it (a restart of its server) gets it back at the next look
            new[0].loras.clear()
            await adapters.sync(runtime)
            assert "tuned" in new[0].loras and new[0].served.lora_calls == [("load", "tuned")]
            assert adapters.of(1).loaded == {f.name: {"tuned"} for f in new}

            await adapters.remove(runtime, "tuned")
            assert adapters.owner("tuned") is None and all(f.loras == {} for f in new)
            assert adapters.modules(1) == [] and AdapterStore(sc.db).all() == []
        finally:
            await adapters.close()


async def test_an_adapter_one_instance_cannot_load_is_refused_and_left_nowhere(tmp_path: Path) -> None:
    scripts = iter([Script(), Script(lora_ok=False)])
    async with Scenario(tmp_path, values={"replicas": 2, "enable_lora": True},
                        script=lambda _spec: next(scripts, Script())) as sc:
        adapters, runtime = served_by(sc)
        await adapters.start()
        try:
            give_demo_weights(sc.config.data_dir / "models" / "demo")
            make_adapter(sc.config.data_dir / "models" / "tuned")
            await sc.until(sc.serving_revision(1, instances=2))
            with pytest.raises(AdapterInvalidError, match="vLLM did not load it"):
                await adapters.register(runtime, "tuned", "models/tuned", "test")
            assert adapters.owner("tuned") is None and AdapterStore(sc.db).all() == []
            assert all(f.loras == {} for f in sc.placement.live())  # the one that loaded it unloaded it
        finally:
            await adapters.close()
