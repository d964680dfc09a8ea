"""The LoRA adapters the fleet serves: registered under a deployment, checked against its base model before anything
starts, and served by every instance of it — from an instance's start (vLLM's ``--lora-modules``: a replica, the new
instance of an apply, a bridge, one started again) and live on those that serve (vLLM's runtime LoRA endpoints on
the instance's loopback port, behind its key; the gateway never forwards them).

An adapter is a model name on /v1 (GET /v1/models lists it with its base as parent) only once every instance that
serves its deployment has it: a request for it never meets an instance that does not know it. Removed, the name
goes first, then the adapter from each instance. Every few seconds each serving instance's own list (its GET
/v1/models) is compared with the registered adapters and brought in step (an instance that lost one, a load that
failed): what is loaded where is what the instances say, not what was asked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from engine.adapters import AdapterStore, check_name, inspect
from engine.db import LoraAdapter
from engine.errors import AdapterConflictError, AdapterInvalidError, EngineError
from engine.revisions import EngineSettings

if TYPE_CHECKING:
    from engine.deployments.fleet import Runtime
    from engine.serving import Instance

log = logging.getLogger("llmops.adapters")
SYNC_S = 5.0  # how often every serving instance's adapters are compared with the registered ones
CALL_TIMEOUT_S = 120.0  # a load reads the adapter's weights (and a GPU copy): seconds for a large one


class AdapterLoadError(EngineError):
    """An instance refused to load or unload an adapter (its answer says why)."""


@dataclass
class Served:
    """The adapters of one deployment: registered (in the store), listed (a model name on /v1), loaded where."""

    rows: dict[str, LoraAdapter] = field(default_factory=dict)
    listed: set[str] = field(default_factory=set)
    loaded: dict[str, set[str]] = field(default_factory=dict)  # instance -> the adapters it said it has
    failures: dict[str, str] = field(default_factory=dict)  # adapter -> why its last load failed somewhere


class Adapters:
    """The fleet's adapters (one per engine)."""

    def __init__(self, store: AdapterStore, runtimes: Callable[[], Iterable[Runtime]], data_dir: Path,
                 model_roots: list[Path] | None) -> None:
        self.store = store
        self.runtimes = runtimes
        self.data_dir = data_dir
        self.model_roots = model_roots
        self.by_deployment: dict[int, Served] = {}
        self._locks: dict[int, asyncio.Lock] = {}
        self._http: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self.on_change: list[Callable[[], None]] = []  # told when the names on /v1 change (the gateway)

    # --- what the fleet and the gateway ask (on the loop, no I/O) ----------------------------------------------

    def of(self, deployment_id: int) -> Served:
        return self.by_deployment.setdefault(deployment_id, Served())

    def modules(self, deployment_id: int) -> list[tuple[str, str]]:
        """(name, folder) of every adapter registered under the deployment: what a new instance starts with."""
        return [(r.name, r.path) for r in self.of(deployment_id).rows.values()]

    def owner(self, model: str) -> int | None:
        """The deployment whose listed adapter ``model`` is, or None."""
        for deployment_id, served in self.by_deployment.items():
            if model in served.listed:
                return deployment_id
        return None

    # --- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        rows = await asyncio.to_thread(self.store.all)
        for row in rows:
            served = self.of(row.deployment_id)
            served.rows[row.name] = row
            served.listed.add(row.name)  # instances start with them (--lora-modules); the sync checks the rest
        self._http = httpx.AsyncClient(timeout=CALL_TIMEOUT_S)
        self._task = asyncio.create_task(self._run(), name="adapters")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

    def forget(self, deployment_id: int) -> None:
        self.by_deployment.pop(deployment_id, None)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SYNC_S)
            for runtime in list(self.runtimes()):
                try:
                    await self.sync(runtime)
                except (httpx.HTTPError, AdapterLoadError, ValueError) as exc:  # (ValueError: an answer that is
                    log.warning("adapters of %s: %s", runtime.name, exc)  # not JSON) the next look tries again

    # --- register, remove --------------------------------------------------------------------------------------

    async def register(self, runtime: Runtime, name: str, path: str, by: str) -> LoraAdapter:
        """Check the adapter against the deployment's desired revision, record it, load it on every instance that
        serves, then list it. AdapterInvalidError / AdapterConflictError: nothing changed."""
        check_name(name)
        taken = self._taken(name)
        if taken:
            raise AdapterConflictError(f"{name!r} is taken: {taken}")
        settings = await asyncio.to_thread(self._desired_settings, runtime)
        info = await asyncio.to_thread(inspect, path, settings, data_dir=self.data_dir, roots=self.model_roots)
        deployment_id = runtime.ref.id
        async with self._lock(deployment_id):
            row = await asyncio.to_thread(self.store.add, deployment_id, name, info, by)
            served = self.of(deployment_id)
            served.rows[name] = row
            try:
                for inst in self._serving(runtime):
                    await self._load(runtime, inst, row)
            except (httpx.HTTPError, AdapterLoadError) as exc:
                served.rows.pop(name, None)
                await asyncio.to_thread(self.store.delete, deployment_id, name)
                for inst in self._serving(runtime):
                    if name in served.loaded.get(inst.name, set()):
                        await self._unload(runtime, inst, name)
                raise AdapterInvalidError("path", f"vLLM did not load it: {exc}") from None
            served.listed.add(name)
        self._changed()
        return row

    async def remove(self, runtime: Runtime, name: str) -> LoraAdapter:
        deployment_id = runtime.ref.id
        async with self._lock(deployment_id):
            row = await asyncio.to_thread(self.store.delete, deployment_id, name)
            served = self.of(deployment_id)
            served.listed.discard(name)
            served.rows.pop(name, None)
            served.failures.pop(name, None)
            self._changed()
            for inst in self._serving(runtime):
                try:
                    await self._unload(runtime, inst, name)
                except (httpx.HTTPError, AdapterLoadError) as exc:  # the sync tries again
                    log.warning("adapter %s on %s: %s", name, inst.name, exc)
        return row

    async def sync(self, runtime: Runtime) -> None:
        """Bring each serving instance's adapters in step with the registered ones (their own list decides)."""
        served = self.of(runtime.ref.id)
        async with self._lock(runtime.ref.id):
            alive = set()
            for inst in self._serving(runtime):
                alive.add(inst.name)
                have = await self._listed(inst)
                served.loaded[inst.name] = have
                for name in sorted(have - served.rows.keys()):
                    await self._unload(runtime, inst, name)
                for name, row in sorted(served.rows.items()):
                    if name not in have:
                        try:
                            await self._load(runtime, inst, row)
                            served.failures.pop(name, None)
                        except AdapterLoadError as exc:
                            served.failures[name] = str(exc)
            for gone in set(served.loaded) - alive:
                served.loaded.pop(gone, None)

    # --- helpers -----------------------------------------------------------------------------------------------

    def _taken(self, name: str) -> str | None:
        for runtime in list(self.runtimes()):
            if name == runtime.name:
                return "a deployment has that name"
            if name in runtime.controller.served_names():
                return f"deployment {runtime.name} serves a model of that name"
            if name in self.of(runtime.ref.id).rows:
                return f"an adapter of deployment {runtime.name}"
        return None

    @staticmethod
    def _desired_settings(runtime: Runtime) -> EngineSettings:
        revision = runtime.revisions.desired_revision()
        if revision is None:
            raise AdapterInvalidError("path", f"deployment {runtime.name} has no revision yet")
        return runtime.writer.validate(dict(revision.values))

    def _serving(self, runtime: Runtime) -> list[Instance]:
        return [i for i in runtime.controller.instances.serving()
                if i.settings.enable_lora and not i.child.exited and i.role != "sleeping"]

    def _lock(self, deployment_id: int) -> asyncio.Lock:
        return self._locks.setdefault(deployment_id, asyncio.Lock())

    def _changed(self) -> None:
        for hook in self.on_change:
            hook()

    async def _listed(self, inst: Instance) -> set[str]:
        assert self._http is not None
        resp = await self._http.get(f"{inst.child.url}/v1/models", headers=inst.child.headers, timeout=10)
        resp.raise_for_status()
        body = resp.json()
        data = body.get("data") if isinstance(body, dict) else None
        return {str(m.get("id")) for m in data or [] if isinstance(m, dict) and m.get("parent")}

    async def _load(self, runtime: Runtime, inst: Instance, row: LoraAdapter) -> None:
        assert self._http is not None
        started = time.monotonic()
        resp = await self._http.post(f"{inst.child.url}/v1/load_lora_adapter", headers=inst.child.headers,
                                     json={"lora_name": row.name, "lora_path": row.path})
        if resp.status_code >= 400 and "already been loaded" not in resp.text:
            raise AdapterLoadError(f"instance {inst.name} answered {resp.status_code}: {_reason(resp)}")
        self.of(runtime.ref.id).loaded.setdefault(inst.name, set()).add(row.name)
        await runtime.events.emit("adapter_loaded", f"adapter {row.name} loaded on instance {inst.name} in "
                                  f"{time.monotonic() - started:.2f} s", data={"adapter": row.name,
                                                                               "instance": inst.name})

    async def _unload(self, runtime: Runtime, inst: Instance, name: str) -> None:
        assert self._http is not None
        resp = await self._http.post(f"{inst.child.url}/v1/unload_lora_adapter", headers=inst.child.headers,
                                     json={"lora_name": name})
        if resp.status_code >= 400 and resp.status_code != 404 and "not found" not in resp.text.lower():
            raise AdapterLoadError(f"instance {inst.name} answered {resp.status_code}: {_reason(resp)}")
        self.of(runtime.ref.id).loaded.get(inst.name, set()).discard(name)


def _reason(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else (body.get("detail") if isinstance(body, dict)
                                                                     else None)
    return str(message or resp.text)[:300]
