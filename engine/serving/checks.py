"""Checks before a start: a revision vLLM must not be given is never started.

- Its model is a local folder that is not there: the demo model is built (the first run of a data dir: about two
  minutes on two cores, as an operation the controller steps through); any other missing folder is said once, and
  looked for again every few seconds.
- A revision written past the API (straight into the database) is checked as the API checks one: a model outside
  the roots, a flag not allowed, a name vLLM would misread. An invalid one is rejected; the last good one serves.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

from engine.clock import Clock
from engine.config import AppConfig
from engine.db import Revision
from engine.errors import InvalidSettingsError
from engine.revisions import EngineSettings, model_path, names_local_path, resolve_local_model, validate_settings
from engine.schemas import EngineState
from engine.serving.instances import Instances
from engine.serving.intent import Intent
from engine.serving.progress import Progress
from engine.serving.recorder import Recorder
from engine.vllm import ChildLog, at_nice, kill_group

S = EngineState
MISSING_RETRY_S = 5.0
Verdict = Literal["ok", "build", "wait", "invalid"]
REPO = Path(__file__).resolve().parents[2]  # where `python -m engine.cli` is found


class Checks:
    def __init__(self, config: AppConfig, instances: Instances, progress: Progress, recorder: Recorder,
                 intent: Intent, clock: Clock, log_: ChildLog) -> None:
        self.config = config
        self.instances = instances
        self.progress = progress
        self.recorder = recorder
        self.intent = intent
        self.clock = clock
        self.log = log_
        self._missing: int | None = None  # the revision whose missing model folder was said
        self._built_failed = False  # the latest demo-model build failed: say so before building again
        # how the demo model is built: `llmops demo-model` on the data dir (tests give a quicker command)
        self.demo_command = [config.vllm_python, "-m", "engine.cli", "demo-model", "--data-dir", str(config.data_dir)]

    async def verdict(self, revision: Revision) -> Verdict:
        """Whether ``revision`` may start now: ok; build the demo model first; wait (its model is missing); or
        invalid (rejected)."""
        assert revision.id is not None
        settings = EngineSettings.model_construct(**revision.values)
        data_dir = self.config.data_dir.resolve()
        missing = await self._missing_model(revision.id, settings.model, data_dir)
        if missing is not None:
            return missing
        return "ok" if await self._valid(revision, data_dir) else "invalid"

    async def _missing_model(self, revision_id: int, model: str, data_dir: Path) -> Verdict | None:
        if not names_local_path(model) or resolve_local_model(model, data_dir) is not None:
            self._missing = None
            self._built_failed = False
            return None
        where = model_path(model, data_dir)
        if where == Path(os.path.abspath(self.config.demo_model_dir.resolve())) and not self._built_failed:
            return "build"
        self._built_failed = False  # the next attempt builds it again
        message = (f"the model folder {where} has no config.json: copy the model there, or write settings that "
                   f"name another model (`llmops demo-model --data-dir {self.config.data_dir}` builds the demo model)")
        if self._missing != revision_id:
            self._missing = revision_id
            await self.recorder.event("model_missing", message, "error", revision_id,
                                      data={"model": model, "path": str(where)})
        if not self.instances.serving():
            self.progress.enter_if(S.FAILED, message)
        self.intent.next_attempt = self.clock.monotonic() + MISSING_RETRY_S
        return "wait"

    async def _valid(self, revision: Revision, data_dir: Path) -> bool:
        assert revision.id is not None
        try:
            await asyncio.to_thread(validate_settings, dict(revision.values), data_dir, self.config.model_roots)
        except InvalidSettingsError as exc:
            reasons = exc.describe()
            await self.recorder.mark_rejected(revision.id, f"invalid: {reasons}")
            await self.recorder.event("rejected", f"revision {revision.id} was not started: {reasons}", "error",
                                      revision.id, data={"errors": exc.errors})
            return False
        return True

    async def build_demo_model(self) -> AsyncIterator[None]:
        """Train the demo model into the data dir (about two minutes on two cores), its progress as the reason."""
        self.progress.enter(S.STARTING, "building the demo model: the first run of this data dir (about 2 minutes)")
        await self.recorder.event("demo_model_building", "building the demo model for the first run of this data dir")
        args = at_nice(list(self.demo_command), self.config.vllm_nice)
        proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True, cwd=str(REPO))
        t0 = self.clock.monotonic()
        reader = asyncio.ensure_future(self._follow(proc, t0))
        try:
            while not reader.done():
                yield
            await reader
        except (asyncio.CancelledError, GeneratorExit):
            kill_group(proc.pid, signal.SIGKILL)
            reader.cancel()
            raise
        built = proc.returncode == 0 and (self.config.demo_model_dir / "config.json").is_file()
        self._built_failed = not built
        seconds = self.clock.monotonic() - t0
        await self.recorder.event("demo_model_built" if built else "demo_model_failed",
                                  f"demo model built in {seconds:.0f} s" if built else
                                  f"building the demo model failed (exit {proc.returncode}); see vLLM's log",
                                  "info" if built else "error")

    async def _follow(self, proc: asyncio.subprocess.Process, t0: float) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self.log.write(f"[demo-model] {line}")
            if "step" in line:
                self.progress.say(f"building the demo model ({self.clock.monotonic() - t0:.0f} s): {line.strip()}")
        await proc.wait()
