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
