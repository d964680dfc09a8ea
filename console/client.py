"""Typed httpx client of the engine's API: the only path from the console and the CLI to the engine."""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Any

import httpx
from pydantic import BaseModel, TypeAdapter

DEFAULT_ENGINE_URL = "http://127.0.0.1:8000"


class ClientError(Exception):
    """The engine could not do what was asked; the message says what happened."""


class EngineUnreachableError(ClientError):
    pass


class ApiError(ClientError):
    def __init__(self, status: int, detail: Any) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"engine answered {status}: {detail}")


class SettingsRejectedError(ApiError):
    """422: each entry of ``fields`` is (field, reason)."""

    @property
    def fields(self) -> list[tuple[str, str]]:
        out = []
        for err in self.detail if isinstance(self.detail, list) else []:
            loc = [str(p) for p in err.get("loc", []) if p not in ("body", "values")]
            fit = err.get("fit")
            hint = " (fits: " + ", ".join(f"{k}={v}" for k, v in fit.items()) + ")" if fit else ""
            out.append((".".join(loc) or "?", str(err.get("msg", "")) + hint))
        return out

    def __str__(self) -> str:
        return "settings rejected: " + "; ".join(f"{f}: {m}" for f, m in self.fields)


class StaleRevisionError(ApiError):
    pass


class NotFoundError(ApiError):
    pass


class GatewayInfo(BaseModel):
    in_flight: int
    waiting: int
    rejected: int


class EngineStatus(BaseModel):
    state: str
    since: datetime
    reason: str
    running_revision: int | None
    desired_revision: int | None
    model: str | None
    pid: int | None
    vllm_version: str | None
    vllm_build: str
    enabled: bool
    ready_since: datetime | None
    restarts: int
    gateway: GatewayInfo


class RevisionInfo(BaseModel):
    revision: int
    values: dict[str, Any]
    status: str
    status_reason: str
    author: str
    note: str
    created_at: datetime
    parent_revision: int | None
    forced: bool
    warnings: list[dict[str, Any]]
    oom_count: int = 0


class EventInfo(BaseModel):
    id: int
    ts: datetime
    kind: str
    severity: str
    message: str
    revision: int | None
    data: dict[str, Any]


_revisions = TypeAdapter(list[RevisionInfo])
_events = TypeAdapter(list[EventInfo])


class EngineClient:
    def __init__(self, base_url: str | None = None, *, timeout: float = 10.0, user: str | None = None) -> None:
        self.base_url = (base_url or os.environ.get("LLMOPS_ENGINE_URL") or DEFAULT_ENGINE_URL).rstrip("/")
        headers = {"x-llmops-user": user} if user else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise EngineUnreachableError(
                f"cannot reach the engine at {self.base_url} ({type(exc).__name__}); is `llmops engine` running?"
            ) from exc
        if resp.status_code < 400:
            return resp.json()
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        errors: dict[int, type[ApiError]] = {422: SettingsRejectedError, 409: StaleRevisionError, 404: NotFoundError}
        raise errors.get(resp.status_code, ApiError)(resp.status_code, detail)

    # --- health and status ----------------------------------------------------------------------------------

    def healthz(self) -> bool:
        try:
            return bool(self._request("GET", "/healthz").get("ok"))
        except ClientError:
            return False

    def status(self) -> EngineStatus:
        return EngineStatus.model_validate(self._request("GET", "/api/status"))

    def wait_for(self, states: set[str], timeout: float, revision: int | None = None,
                 poll: float = 0.5) -> EngineStatus:
        """Poll until the engine is in one of ``states`` (and runs ``revision``, if given), or TimeoutError."""
        deadline = time.monotonic() + timeout
        last: EngineStatus | None = None
        while time.monotonic() < deadline:
            try:
                last = self.status()
            except EngineUnreachableError:
                last = None
            if last and last.state in states and (revision is None or last.running_revision == revision):
                return last
            time.sleep(poll)
        where = f"{last.state} ({last.reason})" if last else "unreachable"
        raise TimeoutError(f"engine not in {sorted(states)} after {timeout:.0f} s; it is {where}")

    # --- settings -------------------------------------------------------------------------------------------

    def settings(self) -> RevisionInfo:
        return RevisionInfo.model_validate(self._request("GET", "/api/settings"))

    def settings_schema(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/api/settings/schema")
        return result

    def revision(self, revision: int) -> RevisionInfo:
        return RevisionInfo.model_validate(self._request("GET", f"/api/settings/{revision}"))

    def history(self, limit: int = 50) -> list[RevisionInfo]:
        return _revisions.validate_python(self._request("GET", "/api/settings/history", params={"limit": limit}))

    def put_settings(self, base_revision: int, values: dict[str, Any], note: str = "",
                     force: bool = False) -> RevisionInfo:
        body = {"base_revision": base_revision, "values": values, "note": note, "force": force}
        return RevisionInfo.model_validate(self._request("PUT", "/api/settings", json=body))

    def capacity(self, values: dict[str, Any]) -> dict[str, Any]:
        """Pre-flight and capacity prediction for values not saved yet."""
        params = {k: ("" if v is None else str(v).lower() if isinstance(v, bool) else v) for k, v in values.items()}
        result: dict[str, Any] = self._request("GET", "/api/capacity", params=params)
        return result

    def rollback(self, revision: int, note: str = "", force: bool = False) -> RevisionInfo:
        body = {"revision": revision, "note": note, "force": force}
        return RevisionInfo.model_validate(self._request("POST", "/api/settings/rollback", json=body))

    # --- engine actions, events, logs -----------------------------------------------------------------------

    def engine_action(self, action: str) -> EngineStatus:
        data = self._request("POST", f"/api/engine/{action}")
        data.pop("accepted", None)
        return EngineStatus.model_validate(data)

    def events(self, since: int = 0, limit: int = 200, kinds: list[str] | None = None,
               newest_first: bool = False) -> list[EventInfo]:
        params: dict[str, Any] = {"since": since, "limit": limit, "newest_first": newest_first}
        if kinds:
            params["kind"] = kinds
        return _events.validate_python(self._request("GET", "/api/events", params=params))

    def logs(self, tail: int = 200) -> list[str]:
        return list(self._request("GET", "/api/logs", params={"tail": tail})["lines"])
