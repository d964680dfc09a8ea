"""Events and logs: what the engine did and why, and vLLM's own output."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Response

from engine.api.convert import event_out
from engine.api.deps import ControllerDep, EventsDep, FleetDep, access
from engine.schemas import MAX_ID, EventOut, LogsOut
from engine.vllm import filter_log

router = APIRouter(tags=["events"])


@router.get("/api/events", response_model=list[EventOut], dependencies=access("viewer"))
def events(log: EventsDep, fleet: FleetDep, since: int = Query(0, ge=0, le=MAX_ID),
           limit: int = Query(200, ge=1, le=5000), kind: list[str] | None = Query(None, max_length=64),
           newest_first: bool = False) -> list[EventOut]:
    """The deployment's events and the engine's own (GPU alerts, the engine starting) after id ``since`` (oldest
    first, or newest first), of the given kinds."""
    names = {r.ref.id: r.name for r in list(fleet.runtimes.values())}
    return [event_out(e, names) for e in log.events(since, limit, kind, newest_first)]


@router.get("/api/logs", response_model=LogsOut, dependencies=access("viewer"))
def logs(controller: ControllerDep, tail: int = Query(200, ge=0, le=5000),
         hide_polling: bool = Query(False, description="leave out /health and /metrics access lines"),
         level: Literal["debug", "info", "warning", "error"] = Query(
             "debug", description="the least level, by meaning: 'error' is a failure (tagged or not, tracebacks "
             "included), never the shutdown output of an instance stopped on purpose"),
         contains: str | None = Query(None, max_length=200, description="only lines with this text "
                                      "(case-insensitive)"),
         fold: bool = Query(True, description="the leak reports each stopping vLLM prints as one line")) -> LogsOut:
    """The last ``tail`` lines of vLLM's output that pass the filters (all runs since the engine started)."""
    lines = filter_log(controller.log.tail(5000), hide_polling=hide_polling, level=level, contains=contains,
                       fold=fold)
    return LogsOut(lines=lines[-tail:] if tail else [], path=str(controller.log.path))


@router.get("/api/logs/download", response_class=Response, dependencies=access("viewer"),
            responses={200: {"description": "vLLM's current log file", "content": {"text/plain": {}}}})
def logs_download(controller: ControllerDep) -> Response:
    """vLLM's current log file, whole (it rotates at log_max_bytes)."""
    try:
        body = controller.log.path.read_bytes()[-controller.config.log_max_bytes:]
    except FileNotFoundError:
        body = b""
    return Response(body, media_type="text/plain; charset=utf-8",
                    headers={"Content-Disposition": 'attachment; filename="vllm.log"'})
