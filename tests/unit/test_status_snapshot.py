"""The status a thread reads (the API's sync handlers, /metrics) is taken on the event loop between two of its
steps: read field by field from a thread, it once showed an apply "applied" beside the reason of its last step,
"draining instance a" (CI, tests/system/test_engine.py)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

from engine.serving.status import StatusView


def fake(loop: asyncio.AbstractEventLoop | None, seen: list[tuple[str, int | None]]) -> Any:
    def snapshot(desired: int | None) -> Any:
        seen.append((threading.current_thread().name, desired))
        return SimpleNamespace(desired_revision=desired)

    return SimpleNamespace(_loop=lambda: loop, snapshot=snapshot,
                           revisions=SimpleNamespace(desired_revision_id=lambda: 7))


def test_a_thread_reads_the_status_on_the_event_loop() -> None:
    seen: list[tuple[str, int | None]] = []

    async def main() -> Any:
        threading.current_thread().name = "the-loop"
        sup = fake(asyncio.get_running_loop(), seen)
        return await asyncio.to_thread(StatusView.status, sup)  # as FastAPI runs a sync handler

    out = asyncio.run(main())
    assert out.desired_revision == 7 and seen == [("the-loop", 7)]


def test_on_the_loop_itself_or_with_no_loop_it_reads_in_place() -> None:
    seen: list[tuple[str, int | None]] = []

    async def main() -> Any:
        return StatusView.status(fake(asyncio.get_running_loop(), seen))

    asyncio.run(main())
    StatusView.status(fake(None, seen))
    here = threading.current_thread().name
    assert seen == [(here, 7), (here, 7)]


def test_a_blocked_loop_does_not_block_the_reader(monkeypatch: Any) -> None:
    """Should the loop not answer (a step that blocks it), the status is read off the loop rather than never."""
    import engine.serving.status as module

    monkeypatch.setattr(module, "STATUS_WAIT_S", 0.2)
    seen: list[tuple[str, int | None]] = []
    loop = asyncio.new_event_loop()
    release = threading.Event()
    ran = threading.Thread(target=loop.run_forever, name="blocked-loop", daemon=True)
    ran.start()
    loop.call_soon_threadsafe(release.wait, 30)  # the loop is stuck in a blocking call
    try:
        out = StatusView.status(fake(loop, seen))
        assert out.desired_revision == 7 and seen == [(threading.current_thread().name, 7)]
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        ran.join(10)
        loop.close()


class _Traced:
    """An apply whose every outcome written notes the state's reason and the apply's step at that moment."""

    def __init__(self, progress: Any, real: Any, at_write: list[tuple[str, str, str]]) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_progress", progress)
        object.__setattr__(self, "_at_write", at_write)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "outcome":
            self._at_write.append((value, self._progress.sm.reason, self._real.step))
        setattr(self._real, name, value)


def ready_progress() -> Any:
    from engine.clock import SystemClock
    from engine.schemas import ApplyPlanOut, EngineState
    from engine.serving.progress import Progress

    progress = Progress(SystemClock())
    progress.enter(EngineState.STARTING, "starting revision 2")
    progress.enter(EngineState.READY, "revision 2 ready")
    progress.begin(3, 2, ApplyPlanOut(kind="blue_green", reason="fits", steps=[]), "apply of revision 3")
    progress.step("draining instance a")
    return progress


def test_an_apply_that_ends_says_what_serves_before_its_outcome_is_written() -> None:
    """A reader off the loop (the loop blocked past STATUS_WAIT_S) that sees "applied" must not see the last step's
    reason beside it: CI (e43d1a3) saw status "applied" with reason "draining instance a"."""
    at_write: list[tuple[str, str, str]] = []
    progress = ready_progress()
    progress.apply = _Traced(progress, progress.apply, at_write)
    progress.done("applied", "revision 3 serving on b")
    progress.finish("revision 3 serving on b")
    assert at_write == [("applied", "revision 3 serving on b (apply of revision 3: applied)", "done")]
    assert progress.sm.reason == "revision 3 serving on b (apply of revision 3: applied)"

    at_write.clear()  # and an apply that ends with no outcome said (aborted)
    progress = ready_progress()
    progress.apply = _Traced(progress, progress.apply, at_write)
    progress.finish("revision 2 serving on a")
    assert at_write == [("aborted", "revision 2 serving on a (apply of revision 3: aborted)", "done")]

    at_write.clear()  # and one rejected (its new instance never became ready): what still serves, at once
    progress = ready_progress()
    progress.apply = _Traced(progress, progress.apply, at_write)
    progress.done("rejected", "revision 2 serving on a")
    assert at_write == [("rejected", "revision 2 serving on a (apply of revision 3: rejected)",
                         "draining instance a")]  # (steps may follow: the old replica brought back)


def test_a_snapshot_off_the_loop_reads_the_apply_before_the_reason() -> None:
    """The loop writes the reason, then the outcome (above); a snapshot read between reads, in a thread, must read
    in the other order (the apply, copied, then the reason) to never pair "applied" with the last step's reason."""
    from engine.serving.status import StatusView

    progress = ready_progress()

    class Racing:  # the state machine, with the loop's writes landing just after its reason is read
        def __init__(self, sm: Any) -> None:
            self.sm = sm

        def __getattr__(self, name: str) -> Any:
            return getattr(self.sm, name)

        @property
        def reason(self) -> str:
            was = str(self.sm.reason)
            if progress.applying:
                progress.done("applied", "revision 3 serving on b")
            return was

        @reason.setter
        def reason(self, value: str) -> None:
            self.sm.reason = value

    class NoInstances(list[Any]):
        primary = None

    progress.sm = Racing(progress.sm)
    admission = SimpleNamespace(in_flight=0, waiting=0, rejected=0, routing="prefix", upstreams=[])
    view: Any = StatusView(SimpleNamespace(name="default"), progress, NoInstances(), admission,  # type: ignore[arg-type]
                           SimpleNamespace(enabled=True, halted=None), SimpleNamespace(), "cpu",  # type: ignore[arg-type]
                           None, lambda: 1, lambda: None, lambda: None)
    out = view.snapshot(3)
    assert out.apply is not None and progress.apply is not None and progress.apply.outcome == "applied"
    assert not (out.apply.outcome == "applied" and "draining" in out.reason), (out.apply.outcome, out.reason)
