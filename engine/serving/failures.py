"""Failures, diagnosed into decisions the controller acts on.

- A new revision's instance that never became ready while another serves: its revision is rejected (diagnosed);
  traffic stayed where it was.
- An instance that failed while others serve: it is stopped; the others serve; a replacement follows after the
  policy's delay.
- vLLM stopped (or never started) with nothing else serving: what is left stops; the diagnosis decides (the
  recovery policy, engine/serving/recovery.py): a revision that never became ready is rolled back (the last good
  one returns), one that ran before is retried with backoff, and a crash loop halts restarts until an operator
  starts again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from sqlalchemy.exc import SQLAlchemyError

from engine.clock import Clock
from engine.revisions import RevisionStore
from engine.schemas import EngineState
from engine.serving.gate import Gate
from engine.serving.instances import Instance, Instances, Verdict
from engine.serving.intent import Intent
from engine.serving.launcher import Launcher
from engine.serving.progress import Progress
from engine.serving.recorder import Recorder
from engine.serving.recovery import Decision, RecoveryPolicy

S = EngineState
LAST_LINES = 30
log = logging.getLogger("llmops.serving")


class Failures:
    def __init__(self, policy: RecoveryPolicy, revisions: RevisionStore, instances: Instances, launcher: Launcher,
                 gate: Gate, progress: Progress, recorder: Recorder, intent: Intent, clock: Clock) -> None:
        self.gate = gate
        self.policy = policy
        self.revisions = revisions
        self.instances = instances
        self.launcher = launcher
        self.progress = progress
        self.recorder = recorder
        self.intent = intent
        self.clock = clock

    def _lines(self, inst: Instance) -> list[str]:
        return list(inst.child.lines)

    async def reject(self, new: Instance, verdict: Verdict) -> None:
        """A new revision's instance did not become ready while another serves (it is stopped): reject its
        revision with a diagnosis; say where traffic stayed."""
        rev_id = new.revision.id
        assert rev_id is not None
        diagnosis = self.policy.decide(rev_id, "pending", False, self._lines(new), self.clock.monotonic()).diagnosis
        await self.recorder.event("failed", f"start of revision {rev_id} failed: {verdict.reason}", "error", rev_id,
                                  data={"exit_code": verdict.exit_code, "was_ready": False, "instance": new.name,
                                        "last_lines": self._lines(new)[-LAST_LINES:]})
        await self.recorder.event("diagnosis", f"{diagnosis.kind}: {diagnosis.explanation} Fix: {diagnosis.fix}",
                                  "error", rev_id, data=diagnosis.as_dict())
        await self.recorder.mark_rejected(rev_id, f"{diagnosis.kind}: {diagnosis.explanation}")
        primary = self.instances.primary
        back = primary.revision.id if primary is not None else None
        apply = self.progress.apply
        gap = (apply.longest_gap_s or 0.0) if apply is not None else 0.0
        stayed = (f"traffic stayed on revision {back}" if gap == 0 else
                  f"revision {back} serves again after {gap:.1f} s with nothing serving")
        message = (f"revision {rev_id} never became ready ({diagnosis.kind}): rejected; {stayed}" if back else
                   f"revision {rev_id} never became ready: rejected")
        await self.recorder.event("rollback", message, "error", rev_id,
                                  data={"rejected": rev_id, "back_to": back, "diagnosis": diagnosis.kind,
                                        "gap_s": gap})
        self.progress.done("rejected", self.instances.text())  # the reason: what serves, not the failed step
        await self.recorder.audit("the automatic rollback", action="settings.auto_rollback",
                                  target=f"revision {rev_id}", before={"revision": rev_id}, after={"revision": back},
                                  detail=message)

    async def beside(self, inst: Instance, reason: str) -> AsyncIterator[None]:
        """``inst`` failed while others serve: stop what is left of it; the others serve; a replacement follows
        after the policy's delay."""
        await self.gate.close(inst)
        self.launcher.kill(inst)
        while not self.launcher.stopped(inst):
            yield
        decision = self.policy.decide(inst.revision.id, "applied", True, self._lines(inst), self.clock.monotonic())
        self.intent.next_attempt = self.clock.monotonic() + decision.delay_s
        await self.recorder.event("instance_failed", f"{reason}; the other instances serve", "error",
                                  inst.revision.id, data={"instance": inst.name,
                                                          "diagnosis": decision.diagnosis.as_dict(),
                                                          "last_lines": self._lines(inst)[-LAST_LINES:]})

    async def recover(self, inst: Instance, reason: str, exit_code: int | None, *,
                      was_ready: bool) -> AsyncIterator[None]:
        """vLLM stopped without being asked (or never started) and nothing else serves: stop what is left,
        diagnose, then roll back, retry or halt."""
        await self.gate.close_all()
        # failed from now: what is left of its process group (an engine core, workers) may take stop_timeout_s
        # to go, and its log is only complete for diagnosis once it has
        self.progress.enter_if(S.FAILED, f"{reason}; stopping what is left of it")
        while left := [other for other in self.instances if not self.launcher.stopped(other)]:
            for other in left:
                self.launcher.kill(other)  # (one under another operation is killed once that is over)
            yield
        rev_id = inst.revision.id
        status = await self._status(rev_id)
        decision = self.policy.decide(rev_id, status, was_ready, self._lines(inst), self.clock.monotonic())
        diag = decision.diagnosis
        self.progress.say(f"{reason}: {diag.kind}")
        await self.recorder.event("failed", reason, "error", rev_id,
                                  data={"exit_code": exit_code, "was_ready": was_ready,
                                        "last_lines": self._lines(inst)[-LAST_LINES:]})
        await self.recorder.event("diagnosis", f"{diag.kind}: {diag.explanation} Fix: {diag.fix}", "error", rev_id,
                                  data=diag.as_dict())
        if decision.action == "rollback":
            self.progress.done("rejected")
        await self.act(decision, rev_id)

    async def _status(self, rev_id: int | None) -> str | None:
        """The revision's status (pending: never ready), None when it cannot be read (the store is down: a
        failure then counts as one of a revision that ran, retried, never rolled back on a guess)."""
        if rev_id is None:
            return None
        try:
            return (await asyncio.to_thread(self.revisions.get_revision, rev_id)).status
        except SQLAlchemyError as exc:
            log.error("serving: the status of revision %s cannot be read (%s)", rev_id, exc)
            return None

    async def act(self, decision: Decision, rev_id: int | None) -> None:
        diag = decision.diagnosis
        if decision.action == "rollback" and rev_id is not None:
            await self.recorder.mark_rejected(rev_id, f"{diag.kind}: {diag.explanation}")
            try:
                back = await asyncio.to_thread(self.revisions.desired_revision_id)
            except SQLAlchemyError:
                back = None
            self.intent.next_attempt = 0.0
            await self.recorder.event("rollback", decision.message + (
                f" (revision {back})" if back else "; no revision was ever ready: write new settings"), "error",
                rev_id, data={"rejected": rev_id, "back_to": back, "diagnosis": diag.kind})
            await self.recorder.audit("the automatic rollback", action="settings.auto_rollback",
                                      target=f"revision {rev_id}", before={"revision": rev_id},
                                      after={"revision": back}, detail=decision.message)
        elif decision.action == "halt":
            self.intent.halted = decision.message
            await self.gate.refuse(f"vLLM is halted: {decision.message}")
            self.progress.say(decision.message)
            await self.recorder.event("crash_loop", decision.message, "critical", rev_id,
                                      data={"diagnosis": diag.kind})
            await self.recorder.audit("the halt", action="engine.halt", target=f"revision {rev_id}",
                                      detail=decision.message)
        else:
            self.intent.next_attempt = self.clock.monotonic() + decision.delay_s
            await self.recorder.event("restart_scheduled", decision.message, "warning", rev_id,
                                      data={"delay_s": decision.delay_s, "diagnosis": diag.kind})
